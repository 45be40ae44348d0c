// grade.cpp — see grade.h.
#include "grade.h"

#include <fcntl.h>
#include <pwd.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <set>
#include <sstream>
#include <thread>

#include "intake.h"
#include "launch.h"
#include "run_log.h"
#include "k2c/core/todo.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace k2c::grader {
namespace {

// `prefix`, 32 hex digits from the kernel's random source, then `suffix`: a name that no run can
// guess in a folder it may pass through but not list (mkdtemp's six characters, about 36 bits, are
// within reach of a run that asks for names for its whole time limit).
std::string random_name(const std::string& prefix, const std::string& suffix = "") {
  unsigned char bytes[16];
  for (std::size_t got = 0; got < sizeof bytes;) {
    const ssize_t n = getrandom(bytes + got, sizeof bytes - got, 0);
    if (n < 0 && errno != EINTR) throw std::runtime_error(std::string("cannot draw a random name: ") + std::strerror(errno));
    if (n > 0) got += static_cast<std::size_t>(n);
  }
  std::string name = prefix;
  for (const unsigned char b : bytes) name += "0123456789abcdef"[b >> 4], name += "0123456789abcdef"[b & 15];
  return name + suffix;
}

// A file holding `text` for one child to read, made in `dir` (a RunsFolder), read-only (0444) and
// the grader's, so that the code under test running as another user cannot rewrite it; removed
// when this goes out of scope.
class PrivateCopy {
 public:
  PrivateCopy(const std::string& text, const fs::path& dir, const std::string& prefix, const std::string& suffix) {
    const std::string name = (dir / random_name(prefix, suffix)).string();
    const int fd = open(name.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_NOFOLLOW | O_CLOEXEC, 0444);
    if (fd < 0) throw std::runtime_error("cannot create a file in " + dir.string() + ": " + std::strerror(errno));
    std::size_t done = 0;
    while (done < text.size()) {
      const ssize_t n = write(fd, text.data() + done, text.size() - done);
      if (n <= 0 && errno != EINTR) break;
      if (n > 0) done += static_cast<std::size_t>(n);
    }
    close(fd);
    if (done < text.size()) {
      unlink(name.c_str());
      throw std::runtime_error("cannot write " + name);
    }
    path_ = name;
  }
  ~PrivateCopy() { unlink(path_.c_str()); }
  PrivateCopy(const PrivateCopy&) = delete;
  PrivateCopy& operator=(const PrivateCopy&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A module's implementation library: in lib/ (CMAKE_LIBRARY_OUTPUT_DIRECTORY), else wherever the
// build put it; empty when the module has none (the fake course's older modules).
fs::path impl_library(const fs::path& build, const std::string& id) {
  const std::string name = "libk2c_impl_" + id + ".so";
  std::error_code ec;
  if (fs::is_regular_file(build / "lib" / name, ec)) return build / "lib" / name;
  for (auto it = fs::recursive_directory_iterator(build, fs::directory_options::skip_permission_denied, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec))
    if (it->path().filename() == name && it->is_regular_file(ec)) return it->path();
  return {};
}

// Run verdicts that void a module's points: the run did not produce results to trust.
const std::set<std::string> kModuleLevelFailures = {"crashed", "timed out", "no report", "incomplete", "invalid"};

// A module's status from its tests' verdicts. Tests worth no points (Contract.Implemented, a
// listing check) do not make a stub "partial": what counts is whether anything that earns
// points passed. A bonus part left unwritten, or one this machine cannot run, does not count
// against the module either.
std::string module_status(const std::vector<TestOutcome>& all) {
  std::vector<TestOutcome> tests;
  for (const TestOutcome& t : all)
    if (!(t.bonus && (t.status == "not implemented" || t.status == "skipped"))) tests.push_back(t);
  if (tests.empty()) tests = all;
  int passed = 0, passed_for_points = 0, failed = 0, not_implemented = 0, skipped = 0;
  for (const TestOutcome& t : tests) {
    passed += t.status == "passed";
    passed_for_points += t.status == "passed" && t.max_points > 0;
    failed += t.status == "failed";
    not_implemented += t.status == "not implemented";
    skipped += t.status == "skipped";
  }
  const int total = static_cast<int>(tests.size());
  if (passed == total) return "ok";
  if (skipped == total) return "skipped";
  if (not_implemented > 0 && failed == 0 && passed_for_points == 0) return "not implemented yet";
  return passed > 0 ? "partial" : "failed";
}

// A module's points and status again, after a check of the grader's own changed one of its tests.
void retotal(ModuleOutcome& m) {
  m.points = 0;
  for (const TestOutcome& x : m.tests) m.points += x.points;
  m.status = module_status(m.tests);
}

// Where an untouched stub should be started: the K2C_TODO that the first not-implemented test
// ran into (its message, after the marker, is "what (FILE:LINE)"), with the path from
// assignments/ on (the file was compiled from a staging copy, whose folder means nothing to the
// student). Empty if none.
std::string todo_location(const std::vector<TestOutcome>& tests) {
  for (const TestOutcome& t : tests) {
    if (t.status != "not implemented") continue;
    const std::size_t close = t.message.rfind(')');
    const std::size_t open = close == std::string::npos ? std::string::npos : t.message.rfind('(', close);
    if (open == std::string::npos) continue;
    std::string where = t.message.substr(open + 1, close - open - 1);
    if (where.find(':') == std::string::npos) continue;
    if (const std::size_t a = where.rfind("assignments/"); a != std::string::npos) where = where.substr(a);
    return where;
  }
  return "";
}

// Why tests were skipped, one reason at a time in the order first met: "2 skipped (no CUDA
// device: ...); 1 skipped (needs 2 GPUs)". It counts and names no test: the table names each
// skipped test once, in its own place (print_table), and the JSON lists every one with its reason.
std::string skip_summary(const std::vector<TestOutcome>& tests) {
  std::vector<std::pair<std::string, int>> reasons;
  for (const TestOutcome& t : tests) {
    if (t.status != "skipped") continue;
    auto it = std::find_if(reasons.begin(), reasons.end(), [&](const auto& r) { return r.first == t.message; });
    if (it == reasons.end()) reasons.emplace_back(t.message, 1);
    else ++it->second;
  }
  std::string out;
  for (const auto& [why, n] : reasons)
    out += (out.empty() ? "" : "; ") + std::to_string(n) + " skipped" +
           (why.empty() || why == "skipped" ? "" : " (" + why + ")");
  return out;
}

// Why the build holds no test program for a module of the rubric being graded. The build
// declares each module from its entry in the course's autograder/rubric.json
// (autograder/CMakeLists.txt), and leaves out a gpu module where it found no CUDA toolkit and an
// mpi module where it found no MPI.
std::string not_built_reason(const ModuleSpec& spec, const fs::path& source_root, const json& build_info) {
  bool registered = true;  // where the course's rubric cannot be read, the kind's reason stands
  try {
    const Rubric course = load_rubric((source_root / "autograder" / "rubric.json").string());
    registered = std::any_of(course.modules.begin(), course.modules.end(),
                             [&](const ModuleSpec& m) { return m.id == spec.id; });
  } catch (const std::exception&) {
  }
  if (!registered)
    return "not declared in the build: autograder/rubric.json has no entry with \"id\": \"" + spec.id +
           "\" (the build declares one module per entry there)";
  if (spec.kind == "gpu" && !build_info.value("cuda", false))
    return "this build has no CUDA toolkit (nvcc not found)";
  if (spec.kind == "mpi")
    return "this build has no MPI (Open MPI's library and mpirun were not found when it was configured: "
           "make deps)";
  return "not declared in the build, although autograder/rubric.json has its entry: see CMake's configure "
         "output";
}

// Who runs the code under test. A grader running as root hands it an unprivileged account
// (nobody by default), so that a submission can write neither the course, nor the build tree
// (a later module's programs), nor the grader, nor read the grader's memory. That needs the
// account to reach what the tests read (the course and build trees: every folder on the way
// searchable by others, files readable under the umask) and the GPU (device nodes open to all);
// where it cannot, the code runs as root and the report says why.
struct Runner {
  int uid = -1, gid = -1;  // -1: the grader's own user
  std::string name, note;
  bool private_tmp = false;  // each run gets /tmp, /var/tmp and /dev/shm of its own (process.h)
  bool private_pids = false;  // and processes of its own (process.h)
  bool private_net = false;   // and a network of its own (process.h)
  fs::path runs;              // where its run folders and rubric copies are made (RunsFolder); "": TMPDIR
  std::string temp_folders = "shared with the machine (code under test runs as the grader)";
  std::string processes = "shared with the machine (code under test runs as the grader)";
  std::string network = "shared with the machine (code under test runs as the grader)";
};

bool searchable_by_others(const fs::path& path, std::string& blocked) {
  fs::path at;
  for (const fs::path& part : fs::absolute(path).lexically_normal()) {
    at /= part;
    struct stat st {};
    if (stat(at.c_str(), &st) != 0) return true;  // not made yet: created by the grader, umask rules
    if (S_ISDIR(st.st_mode) && !(st.st_mode & S_IXOTH)) {
      blocked = at.string();
      return false;
    }
  }
  return true;
}

Runner choose_runner(const GradeOptions& o) {
  Runner r;
  if (geteuid() != 0) {
    r.name = "the grader's own user";
    return r;
  }
  if (o.run_as == "self") {
    r.name = "root";
    r.note = "as asked (--run-as self)";
    return r;
  }
  const std::string name = o.run_as.empty() ? "nobody" : o.run_as;
  const passwd* pw = getpwnam(name.c_str());
  if (pw == nullptr) {
    if (!o.run_as.empty()) throw std::runtime_error("--run-as " + name + ": no such user");
    r.name = "root";
    r.note = "this machine has no user nobody (--run-as USER names another)";
    return r;
  }
  r.name = "root";
  const mode_t mask = umask(022);
  umask(mask);
  std::string blocked;
  if (mask & 005) {
    r.note = name + " could not read what the build writes (umask " + std::to_string(mask) + ")";
    return r;
  }
  std::error_code tmp_ec;
  const fs::path tmp = fs::temp_directory_path(tmp_ec);  // the run folders and rubric copies
  for (const std::string& dir : {o.root, o.build_dir, tmp_ec ? std::string("/tmp") : tmp.string()})
    if (!searchable_by_others(dir, blocked)) {
      r.note = name + " cannot reach " + blocked + " (not searchable by others)";
      return r;
    }
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/dev", ec)) {
    const std::string f = e.path().filename().string();
    struct stat st {};
    if (f.rfind("nvidia", 0) == 0 && stat(e.path().c_str(), &st) == 0 && S_ISCHR(st.st_mode) &&
        (st.st_mode & (S_IROTH | S_IWOTH)) != (S_IROTH | S_IWOTH)) {
      r.note = name + " could not open " + e.path().string() + " (the GPU)";
      return r;
    }
  }
  if (pw->pw_uid == 0) {  // another name for root: nothing to drop (and no one to clean up after)
    r.note = name + " is root";
    return r;
  }
  // A trial switch: without the capability to change users (a container that dropped it, a user
  // namespace without that uid) every run would fail before it starts.
  const ProcessResult trial =
      run_process({"true"}, {.timeout_s = 30, .uid = static_cast<int>(pw->pw_uid), .gid = static_cast<int>(pw->pw_gid)});
  if (trial.exit_code != 0) {
    r.note = "cannot switch to " + name + " (" + first_lines(trial.output.empty() ? describe_exit(trial, 30) : trial.output, 1) + ")";
    return r;
  }
  r.uid = static_cast<int>(pw->pw_uid);
  r.gid = static_cast<int>(pw->pw_gid);
  r.name = name;
  // Temporary folders of each run's own: what a run leaves there, or fills them with, is gone with
  // it, and no run meets what earlier runs left there. Where the machine allows no mount namespace
  // (a container without CAP_SYS_ADMIN) the runs share them, and the report says so.
  const std::string problem = private_tmp_problem();
  r.private_tmp = problem.empty();
  r.temp_folders = r.private_tmp ? "each run's own" : "shared with the machine (" + problem + ")";
  // Processes of each run's own: no run sees, signals or traces another's (two graders of one
  // account at once), and nothing a run starts outlives it. They need the folders' namespace.
  const std::string pids_problem = r.private_tmp ? private_pids_problem() : "its temporary folders are shared";
  r.private_pids = pids_problem.empty();
  r.processes = r.private_pids ? "each run's own" : "shared with the machine (" + pids_problem + ")";
  // A network of each run's own, loopback alone: no run reaches a port or abstract socket of
  // another's (a listener planted where a neighbour's NCCL bootstrap will look), nor an interface
  // of the machine's. Independent of the processes: CUDA's MPS does not care.
  const std::string net_problem = r.private_tmp ? private_net_problem() : "its temporary folders are shared";
  r.private_net = net_problem.empty();
  r.network = r.private_net ? "each run's own (loopback alone)" : "shared with the machine (" + net_problem + ")";
  return r;
}

fs::path temp_folder() {
  std::error_code ec;
  const fs::path dir = fs::temp_directory_path(ec);
  return ec ? fs::path("/tmp") : dir;
}

// A folder this process made, removed with all it holds when this goes out of scope (also when a
// constructor below throws after making it).
class MadeFolder {
 public:
  MadeFolder() = default;
  ~MadeFolder() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
  }
  MadeFolder(const MadeFolder&) = delete;
  MadeFolder& operator=(const MadeFolder&) = delete;
  const fs::path& path() const { return path_; }

 protected:
  // Makes `folder` (mode `mode`, under the umask) and takes it in charge; throws if it cannot.
  void make(const fs::path& folder, mode_t mode) {
    if (mkdir(folder.c_str(), mode) != 0)
      throw std::runtime_error("cannot create a folder in " + folder.parent_path().string() + ": " + std::strerror(errno));
    path_ = folder;
  }

 private:
  fs::path path_;
};

// Where one grading makes its runs' folders and rubric copies: a folder of the grader's own in
// the temporary folder that others may pass through but not list (0711), removed at the end. A
// run knows its own folder and copy by name, and the others' names are random: a run of another
// grading of the same account (a second grader on the machine) that lists the temporary folder
// does not find this one's run folders, which that account owns and so could write. It matters
// where the temporary folder lies outside the run's private /tmp (TMPDIR elsewhere). Where code
// under test runs as another account, a temporary folder that it could rearrange is refused (the
// folder itself or one on the way to it being that account's, or writable by it without the
// sticky bit): the runs folder, or a folder above it, could be moved away and one of the
// runner's put in its place. The folder is used by its canonical path (no link on the way).
class RunsFolder : public MadeFolder {
 public:
  explicit RunsFolder(const Runner& runner) {
    std::error_code ec;
    const fs::path temp = fs::canonical(temp_folder(), ec);
    if (ec) throw std::runtime_error("cannot use the temporary folder " + temp_folder().string() + ": " + ec.message());
    fs::path at;
    for (const fs::path& part : runner.uid >= 0 ? temp : fs::path()) {
      at /= part;
      struct stat st {};
      if (lstat(at.c_str(), &st) != 0)
        throw std::runtime_error("cannot use the temporary folder " + temp.string() + ": " + std::strerror(errno));
      const bool its_own = st.st_uid == static_cast<uid_t>(runner.uid);
      const bool it_writes = (st.st_mode & S_IWOTH) || ((st.st_mode & S_IWGRP) && st.st_gid == static_cast<gid_t>(runner.gid));
      if (its_own || (it_writes && !(st.st_mode & S_ISVTX)))
        throw std::runtime_error("the temporary folder " + temp.string() + " is not safe from code under test: " +
                                 at.string() + " is " +
                                 (its_own ? runner.name + "'s" : "writable by " + runner.name + " without the sticky bit") +
                                 ", so what the grader makes there could be moved; set TMPDIR to another folder (/tmp)");
    }
    make(temp / random_name("k2c-runs-"), 0711);
    // The grader's own, as made (a file system that maps root to another user would not give it).
    struct stat made {};
    const bool ok = chmod(path().c_str(), 0711) == 0 && lstat(path().c_str(), &made) == 0;
    if (!ok || !S_ISDIR(made.st_mode) || made.st_uid != geteuid()) {
      const std::string why = ok ? "it is not the grader's" : std::strerror(errno);
      throw std::runtime_error("cannot make " + path().string() + " a folder of the grader's own (0711): " + why);
    }
  }
};

// A folder for one run of a test program as `runner`: its working directory and HOME, where
// its report is written; owned by the runner, 0700, in the runner's RunsFolder, removed afterwards.
class RunFolder : public MadeFolder {
 public:
  explicit RunFolder(const Runner& runner) {
    make((runner.runs.empty() ? temp_folder() : runner.runs) / random_name("k2c-run-"), 0700);
    if (runner.uid >= 0 && chown(path().c_str(), static_cast<uid_t>(runner.uid), static_cast<gid_t>(runner.gid)) != 0)
      throw std::runtime_error("cannot hand " + path().string() + " to " + runner.name + ": " + std::strerror(errno));
  }
};

// The command-line form of a sanitized run (--sanitize): exit code 86 when memcheck finds errors.
const std::vector<std::string> kSanitizer = {"compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "86",
                                             "--print-limit", "20"};

// One run of k2c_witness `bin` for witness `name` of test program `program`, which it starts as
// `runner` in a fresh run folder; its verdict is written to a folder of the grader's own (0700),
// out of the test program's reach. What that run left behind is killed afterwards.
// `shapes` > 0: a correctness run over that many shapes, see k2c_witness. `ceiling`: for a timed
// run, the rubric's name of the test's ceiling, which the checker measures too where it knows it.
// Runs one of the grader's checkers (k2c_witness, k2c_rank_witness: the same options up to `--`)
// in a fresh folder of the runner's, and reads its verdict; a grader fault says why there is none.
WitnessVerdict run_checker(const fs::path& bin, const std::string& name, const std::vector<std::string>& options,
                           const std::vector<std::string>& program, const Runner& runner, double timeout, double limit) {
  const RunFolder folder(runner);
  const RunFolder verdict_folder(Runner{.runs = runner.runs});
  const fs::path verdict = verdict_folder.path() / "verdict.json";
  const std::string run_mark = folder.path().filename().string();
  std::vector<std::string> cmd = {bin.string(), name, "--out", verdict.string(), "--timeout", std::to_string(timeout),
                                  "--cwd", folder.path().string(), "--env", "K2C_RUN=" + run_mark,
                                  "--env", "HOME=" + folder.path().string(), "--env", "TMPDIR=" + folder.path().string()};
  if (runner.uid >= 0) cmd.insert(cmd.end(), {"--uid", std::to_string(runner.uid), "--gid", std::to_string(runner.gid)});
  if (runner.private_tmp) cmd.push_back("--private-tmp");
  if (runner.private_pids) cmd.push_back("--private-pids");
  if (runner.private_net) cmd.push_back("--private-net");
  cmd.insert(cmd.end(), options.begin(), options.end());
  cmd.push_back("--");
  cmd.insert(cmd.end(), program.begin(), program.end());
  const ProcessResult w = run_process(cmd, {.timeout_s = limit});
  if (runner.uid >= 0) kill_run_leftovers(runner.uid, run_mark);
  WitnessVerdict v = read_witness_verdict(read_report(verdict));
  if (v.fault == "grader" && v.problem.rfind("no verdict", 0) == 0)
    v.problem += " (" + describe_exit(w, limit) + ": " + first_lines(w.output, 1) + ")";
  return v;
}

WitnessVerdict run_witness(const fs::path& bin, const std::string& name, const fs::path& program, const Runner& runner,
                           double timeout, int shapes, const std::string& ceiling) {
  std::vector<std::string> options;
  if (shapes > 0) options = {"--shapes", std::to_string(shapes)};
  if (!ceiling.empty()) options.insert(options.end(), {"--ceiling", ceiling});
  // Each of its sessions (the calibration and the test program's, or one per shape) ends within
  // the test program's own limit; the checker's own work adds little.
  return run_checker(bin, name, options, {program.string()}, runner, timeout, std::max(shapes, 1) * (timeout + 30) + 60);
}

// k2c_rank_witness checks a distributed module's correctness test `name` again (`cases` cases it
// draws) on the `ranks` ranks `launch` starts (the settings mpirun itself reads go as --env).
WitnessVerdict run_rank_witness(const fs::path& bin, const std::string& name, const Launch& launch, int ranks,
                                const Runner& runner, double timeout, int cases) {
  std::vector<std::string> options = {"--ranks", std::to_string(ranks), "--cases", std::to_string(cases)};
  for (const auto& [k, v] : launch.env) options.insert(options.end(), {"--env", k + "=" + v});
  // The ranks' start, then every case, each within the test program's own limit.
  return run_checker(bin, name, options, launch.argv, runner, timeout, 2 * timeout + 60);
}

// One of the grader's checkers (k2c_witness, k2c_rank_witness), built before any code under test
// runs; its bytes then, so that a checker rewritten during grading is noticed before it is used.
struct Checker {
  fs::path bin;
  std::string problem, bytes;  // problem: why it cannot be used ("" when it can)
  // Throws, stopping the grading, if the program changed since it was built.
  void check_unchanged(const std::string& module) const {
    if (read_file(bin) != bytes)
      throw std::runtime_error(bin.string() + " changed while grading " + module +
                               ". Grading stopped: its verdicts can no longer be trusted.");
  }
};

// The environment of every configure and build: a temporary folder of the grader's own (0700)
// inside the build folder. In a shared /tmp the compilers' scratch files (nvcc names them after its
// process id and opens them without O_EXCL) could be made in advance by a process that a run left
// behind, and written while the build reads them: code of its choosing in objects built as the
// grader, kept for every later submission.
// A submission's compiles (compile-as) make their scratch folders beside it, in a folder emptied
// after each build (compile_scratch_env), where the user they run as can reach them.
std::vector<std::pair<std::string, std::string>> build_env(const fs::path& build) {
  const fs::path tmp = build / "tmp";
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(tmp, ec);
  if (fs::exists(st) && !fs::is_directory(st)) fs::remove(tmp, ec);  // a file, or a link, where the folder goes
  fs::create_directories(tmp, ec);
  fs::permissions(tmp, fs::perms::owner_all, fs::perm_options::replace, ec);
  std::vector<std::pair<std::string, std::string>> env = {{"TMPDIR", tmp.string()}};
  const fs::path scratch = build / "compile-scratch";
  std::string blocked;
  // Always set, so that a value inherited from the grader's own environment never reaches a build.
  for (auto& [name, value] : compile_scratch_env(scratch))
    env.emplace_back(name, searchable_by_others(scratch, blocked) ? value : std::string());
  return env;
}

Checker build_checker(const fs::path& build, const std::string& target, const std::string& what, int jobs,
                      std::ostream& progress) {
  Checker c{build / "bin" / target, "", ""};
  progress << "building " << target << " (" << what << ") ...\n" << std::flush;
  const ProcessResult b = run_process({"cmake", "--build", build.string(), "--target", target, "-j", std::to_string(jobs)},
                                      {.env = build_env(build), .timeout_s = 1800});
  if (b.exit_code != 0 || !fs::is_regular_file(c.bin))
    c.problem = target + " did not build: " + first_lines(build_failure_detail(b.output), 1);
  else
    c.bytes = read_file(c.bin);
  return c;
}

// A correctness test's re-check `v` by `checker`: said in the progress, the submission's fault
// kept in the module's log, and applied to the test (apply_recheck).
void record_recheck(ModuleOutcome& m, const std::string& test, const std::string& checker, const WitnessVerdict& v,
                    const std::string& tag, std::ostream& progress) {
  if (!v.fault.empty())
    progress << tag << ": " << test << ": " << (v.fault == "grader" ? "not checked again: " : "") << v.problem << "\n"
             << std::flush;
  if (v.fault == "submission") m.log += "\n[" + checker + "] " + v.problem + "\n" + v.output;
  apply_recheck(m, test, v);
}

// The rank count a distributed module's correctness is checked again at: three ranks where the
// rubric runs them (a count that divides few sizes), else the largest MPI run up to four.
int rank_witness_ranks(const ModuleSpec& spec) {
  int best = 0;
  for (const RunSpec& r : spec.runs) {
    if (r.backend != "mpi") continue;
    if (r.ranks == 3) return 3;
    if (r.ranks <= 4) best = std::max(best, r.ranks);
  }
  return best;
}

}  // namespace

std::string hidden_from_others(const fs::path& root) {
  std::string blocked;
  if (!searchable_by_others(root, blocked)) return blocked;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(root, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    struct stat st {};
    if (lstat(it->path().c_str(), &st) != 0) continue;
    if ((S_ISDIR(st.st_mode) && !(st.st_mode & S_IXOTH)) || (S_ISREG(st.st_mode) && !(st.st_mode & S_IROTH)))
      return it->path().string();
  }
  return ec ? root.string() + " (" + ec.message() + ")" : "";
}

// The first compiler of the build tree's cache (C++, CUDA and its host compiler) that users other
// than its owner cannot run (a folder on its way not searchable by others, or the file not
// executable by them), or "".
std::string compilers_out_of_reach(const fs::path& build) {
  std::istringstream cache(read_file(build / "CMakeCache.txt"));
  for (std::string line; std::getline(cache, line);) {
    if (line.rfind("CMAKE_CXX_COMPILER:", 0) != 0 && line.rfind("CMAKE_CUDA_COMPILER:", 0) != 0 &&
        line.rfind("CMAKE_CUDA_HOST_COMPILER:", 0) != 0)
      continue;
    std::error_code ec;
    const fs::path compiler = fs::canonical(line.substr(line.find('=') + 1), ec);
    if (ec) continue;  // not a path CMake kept: its own check is the configure's
    std::string blocked;
    struct stat st {};
    if (!searchable_by_others(compiler.parent_path(), blocked) || stat(compiler.c_str(), &st) != 0 ||
        !(st.st_mode & S_IXOTH))
      return compiler.string();
  }
  return "";
}

double GradeReport::points() const {
  double s = 0;
  for (const auto& m : modules) s += m.points;
  return s;
}
double GradeReport::max_points() const {
  double s = 0;
  for (const auto& m : modules) s += m.max_points;
  return s;
}

bool nvidia_device_present() {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/dev", ec)) {
    const std::string name = e.path().filename().string();
    if (name == "dxg") return true;
    if (name.size() > 6 && name.rfind("nvidia", 0) == 0 &&
        std::all_of(name.begin() + 6, name.end(), [](unsigned char c) { return std::isdigit(c); }))
      return true;
  }
  return false;
}

ModuleOutcome evaluate_module(const ModuleSpec& spec, const ProcessResult& run,
                              const std::string& gtest_json, const std::string& impl,
                              double timeout_s, bool gpu_here, bool nccl_run) {
  ModuleOutcome m;
  m.id = spec.id;
  m.title = spec.title;
  m.max_points = spec.points();
  m.log = run.output;
  m.seconds = run.seconds;
  // In a distributed run the useful reason is often on another rank: name it.
  const std::string rank_note = rank_failure(run.output);
  auto zero = [&](const std::string& status, const std::string& detail) {
    m.status = status;
    m.detail = detail;
    if (!rank_note.empty() && detail.find(rank_note) == std::string::npos) m.detail += "; " + rank_note;
    m.points = 0;
    for (TestOutcome& t : m.tests) t.points = 0;
    return m;
  };

  // Process-level failures first: none of them leaves a report we could trust.
  if (!run.started) return zero("crashed", "could not start the test program: " + run.output);
  if (run.timed_out) return zero("timed out", describe_exit(run, timeout_s));
  if (const std::string f = fatal_line(run.output); !f.empty()) return zero("crashed", f);
  if (run.signal > 0) return zero("crashed", describe_exit(run, timeout_s));
  if (gtest_json.empty())
    return zero("no report", "the test program ended (" + describe_exit(run, timeout_s) +
                                 ") without writing its report: an early exit() or a crash");
  json report;
  try {
    report = json::parse(gtest_json);
  } catch (const std::exception& e) {
    return zero("no report", std::string("unreadable test report: ") + e.what());
  }
  // GoogleTest exits with 1 when a test failed; anything else (a sanitizer's error code, an
  // exit() from inside the code under test) is not a normal end.
  if (run.exit_code != 0 && run.exit_code != 1)
    return zero("crashed", "abnormal " + describe_exit(run, timeout_s) +
                               (run.exit_code == 86 ? " (compute-sanitizer found errors)" : ""));

  std::map<std::string, const json*> seen;
  if (report.contains("testsuites"))
    for (const json& suite : report["testsuites"])
      if (suite.contains("testsuite"))
        for (const json& t : suite["testsuite"])
          seen[string_property(suite, "name") + "." + string_property(t, "name")] = &t;

  int passed = 0, failed = 0, not_implemented = 0;
  std::string skip_reason = global_property(report, "k2c_gpu_reason");
  for (const TestSpec& ts : spec.tests) {
    TestOutcome t;
    t.name = ts.name;
    t.max_points = ts.points;
    t.bonus = ts.bonus;
    auto it = seen.find(ts.name);
    if (it == seen.end()) {
      t.status = "did not run";
      m.tests.push_back(t);
      return zero("incomplete", "test " + ts.name + " did not report");
    }
    const json& j = *it->second;
    const std::string result = string_property(j, "result");
    const std::string run_status = string_property(j, "status");
    std::string failure;
    if (j.contains("failures"))
      for (const json& f : j["failures"]) failure += string_property(f, "failure") + "\n";

    if (run_status == "NOTRUN" || result == "SUPPRESSED") {
      t.status = "did not run";
      m.tests.push_back(t);
      return zero("incomplete", "test " + ts.name + " was filtered out or disabled");
    }
    if (result == "SKIPPED") {
      t.status = "skipped";
      // Newer GoogleTest versions report the GTEST_SKIP message; older ones only the fact.
      std::string why = string_property(j, "k2c_skip");
      if (why.empty() && j.contains("skipped") && j["skipped"].is_array() && !j["skipped"].empty())
        why = first_lines(string_property(j["skipped"][0], "message"), 1);
      if (why.empty()) why = skip_reason.empty() ? "skipped" : "no CUDA device: " + skip_reason;
      t.message = why;
    } else if (!failure.empty()) {
      const auto marker = failure.find(kNotImplementedMarker);
      if (marker != std::string::npos) {
        t.status = "not implemented";
        t.message = first_lines(failure.substr(marker + std::string(kNotImplementedMarker).size() + 1), 1);
        ++not_implemented;
      } else {
        t.status = "failed";
        t.message = first_lines(failure, 6);
        if (!rank_note.empty() && failure.find("failed on another rank") != std::string::npos)
          t.message += "\n" + rank_note;
        ++failed;
      }
    } else if (result == "COMPLETED") {
      t.status = "passed";
      // A test that needs a device cannot have run on a machine without one, nor one that runs on
      // NCCL only in a run on the MPI backend: the harness skips them there, so the report was
      // written by something else.
      const char* impossible = ts.device && !gpu_here ? "on a machine with no NVIDIA device, a test that needs one"
                               : ts.nccl && !nccl_run ? "by a run on the MPI backend, a test that runs on NCCL only"
                                                      : nullptr;
      if (impossible) {
        m.tests.push_back(t);
        return zero("invalid", ts.name + ": reported passed " + impossible +
                                   ": the report was not written by the course's harness");
      }
      t.points = ts.points;
      ++passed;
    } else {
      t.status = "failed";
      t.message = "unknown result '" + result + "'";
      ++failed;
    }

    if (ts.perf && j.contains("k2c_achieved")) {
      bool ok = true;
      PerfOutcome p;
      p.achieved = number_property(j, "k2c_achieved", &ok);
      p.ceiling = number_property(j, "k2c_ceiling", &ok);
      p.unit = ts.perf->unit;
      p.ceiling_name = ts.perf->ceiling;
      p.required = ts.perf->required(impl);
      if (!ok || !(p.ceiling > 0) || !std::isfinite(p.achieved)) {
        // A failed measurement costs this test, not the module's correctness points.
        if (t.status == "passed") --passed, ++failed;
        t.status = "failed";
        t.points = 0;
        t.message = "no valid performance figures";
        m.tests.push_back(t);
        continue;
      }
      // Recomputed here from the raw figures: the test's own verdict is not taken on trust.
      p.ratio = p.achieved / p.ceiling;
      t.perf = p;
      // Every figure of a GPU or MPI module is measured on a GPU (an MPI module's on its NCCL run).
      if (!gpu_here && spec.kind != "cpu") {
        m.tests.push_back(t);
        return zero("invalid", ts.name + ": performance figures of a GPU run, on a machine with no NVIDIA "
                               "device: the report was not written by the course's harness");
      }
      if (p.ratio > ts.perf->max_ratio) {
        m.tests.push_back(t);
        std::ostringstream os;
        os << ts.name << ": impossible performance figure, " << std::setprecision(3) << p.ratio
           << "x " << p.ceiling_name << " (physical limit " << ts.perf->max_ratio << "x)";
        return zero("invalid", os.str());
      }
      if (t.status == "passed" && p.ratio < p.required) {
        t.status = "failed";
        t.points = 0;
        t.message = "below the bar";
        --passed;
        ++failed;
      }
    } else if (ts.perf && t.status == "passed") {
      t.status = "failed";  // a perf test that passed without reporting figures proves nothing
      t.points = 0;
      t.message = "no performance figures reported";
      ++failed;
      --passed;
    }
    m.points += t.points;
    m.tests.push_back(t);
  }

  m.status = module_status(m.tests);
  if (m.status != "ok") {
    m.detail = skip_summary(m.tests);
    if (not_implemented > 0)
      m.detail += (m.detail.empty() ? "" : "; ") + std::to_string(not_implemented) + " not implemented yet";
    if (const std::string at = todo_location(m.tests); m.status == "not implemented yet" && !at.empty())
      m.detail += "; start at " + at;
  }
  return m;
}

ModuleOutcome combine_runs(const ModuleSpec& spec,
                           const std::vector<std::pair<std::string, ModuleOutcome>>& runs) {
  ModuleOutcome m;
  m.id = spec.id;
  m.title = spec.title;
  m.max_points = spec.points();
  for (const auto& [label, r] : runs) {
    m.seconds += r.seconds;
    m.log += "==== " + label + "\n" + r.log;
  }
  // A run that voids its module voids it here too, named, with the runs skipped after it.
  for (const auto& [label, r] : runs)
    if (kModuleLevelFailures.count(r.status)) {
      m.status = r.status;
      m.detail = label + ": " + r.detail;
      std::string skipped;
      for (const auto& [other, o] : runs)
        if (o.status == "not run") skipped += (skipped.empty() ? "" : ", ") + other;
      if (!skipped.empty()) m.detail += "; not run: " + skipped + " (after the " + label + " run " + r.status + ")";
      m.tests = r.tests;
      for (TestOutcome& t : m.tests) t.points = 0;
      return m;
    }
  // Per test: failed in any run fails; otherwise not implemented; otherwise passed if it passed
  // somewhere (and was skipped elsewhere); skipped only if skipped everywhere.
  for (std::size_t i = 0; i < spec.tests.size(); ++i) {
    TestOutcome t = runs.front().second.tests[i];
    bool any_pass = false, any_fail = false, any_ni = false;
    for (const auto& [label, r] : runs) {
      const TestOutcome& x = r.tests[i];
      if (x.perf) t.perf = x.perf;
      if (x.status == "passed") any_pass = true;
      if (x.status == "failed" && !any_fail) {
        any_fail = true;
        t.message = label + ": " + x.message;
      }
      if (x.status == "not implemented" && !any_ni) {
        any_ni = true;
        if (!any_fail) t.message = x.message;
      }
    }
    t.status = any_fail ? "failed" : any_ni ? "not implemented" : any_pass ? "passed" : "skipped";
    t.points = t.status == "passed" ? spec.tests[i].points : 0;
    m.points += t.points;
    m.tests.push_back(t);
  }
  m.status = module_status(m.tests);
  std::string runs_text;
  for (const auto& [label, r] : runs) runs_text += (runs_text.empty() ? "" : ", ") + label + ": " + r.status;
  m.detail = "runs: " + runs_text;
  if (const std::string skips = skip_summary(m.tests); !skips.empty()) m.detail += "; " + skips;
  if (const std::string at = todo_location(m.tests); m.status == "not implemented yet" && !at.empty())
    m.detail += "; start at " + at;
  return m;
}

ModuleSpec main_part(const ModuleSpec& spec) {
  ModuleSpec out = spec;
  std::erase_if(out.tests, [](const TestSpec& t) { return t.bonus; });
  return out;
}

ModuleSpec bonus_part(const ModuleSpec& spec) {
  ModuleSpec out = spec;
  std::erase_if(out.tests, [](const TestSpec& t) { return !t.bonus; });
  return out;
}

ModuleOutcome merge_bonus(const ModuleSpec& spec, const ModuleOutcome& main, const ModuleOutcome& bonus) {
  if (kModuleLevelFailures.count(main.status)) {
    // The bonus run was skipped (run_until_void): list its tests as not run, and why.
    ModuleOutcome m = main;
    m.max_points = spec.points();
    for (const TestSpec& ts : spec.tests)
      if (ts.bonus) {
        TestOutcome t;
        t.name = ts.name;
        t.max_points = ts.points;
        t.bonus = true;
        t.status = "not run";
        t.message = "the main run " + main.status;
        m.tests.push_back(t);
      }
    if (bonus.status == "not run") m.detail += "; bonus tests not run (the main run " + main.status + ")";
    return m;
  }
  ModuleOutcome m = main;
  m.max_points = spec.points();
  m.seconds += bonus.seconds;
  m.log += "==== bonus tests\n" + bonus.log;
  m.points = 0;
  m.tests.clear();
  const bool bonus_failed = kModuleLevelFailures.count(bonus.status) > 0;
  for (const TestSpec& ts : spec.tests) {
    const std::vector<TestOutcome>& from = ts.bonus ? bonus.tests : main.tests;
    auto it = std::find_if(from.begin(), from.end(), [&](const TestOutcome& t) { return t.name == ts.name; });
    TestOutcome t;
    if (it != from.end()) t = *it;
    t.name = ts.name;
    t.max_points = ts.points;
    t.bonus = ts.bonus;
    if (ts.bonus && bonus_failed) {
      t.status = "failed";
      t.points = 0;
      t.message = "the bonus run " + bonus.status + (bonus.detail.empty() ? "" : ": " + first_lines(bonus.detail, 1, 200));
    }
    m.points += t.points;
    m.tests.push_back(t);
  }
  m.status = module_status(m.tests);
  if (!bonus.detail.empty())
    m.detail += (m.detail.empty() ? "" : "; ") + std::string("bonus run: ") + bonus.detail;
  return m;
}

bool voids_module(const ModuleOutcome& m) { return kModuleLevelFailures.count(m.status) > 0; }

std::vector<std::pair<std::string, ModuleOutcome>> run_until_void(
    const std::vector<std::string>& labels, const std::function<ModuleOutcome(std::size_t)>& launch) {
  std::vector<std::pair<std::string, ModuleOutcome>> runs;
  std::string fault;  // "mpi x2 crashed" once a run voided the module
  for (std::size_t i = 0; i < labels.size(); ++i) {
    if (!fault.empty()) {
      // Its verdict could not change the module's: spare the time limit it might cost.
      ModuleOutcome skipped;
      skipped.status = "not run";
      skipped.detail = "not run: the " + fault;
      skipped.log = skipped.detail + "\n";
      runs.emplace_back(labels[i], skipped);
      continue;
    }
    runs.emplace_back(labels[i], launch(i));
    if (voids_module(runs.back().second)) fault = labels[i] + " run " + runs.back().second.status;
  }
  return runs;
}

std::string build_failure_detail(const std::string& log) {
  const std::vector<std::string> symbols = undefined_symbols(log);
  if (symbols.empty()) return compiler_errors(log);
  // The usual cause is a call into a library the module does not link (cuBLAS, say): name it
  // on the first line, which is the one the progress output and Gradescope show.
  std::string names;
  for (std::size_t i = 0; i < symbols.size() && i < 4; ++i) names += (i ? ", " : "") + symbols[i];
  if (symbols.size() > 4) names += " and " + std::to_string(symbols.size() - 4) + " more";
  return "link failed: undefined symbol" + std::string(symbols.size() > 1 ? "s " : " ") + names + "\n" +
         compiler_errors(log);
}

void withhold_performance(ModuleOutcome& m, const ModuleSpec& spec, const std::string& reason) {
  double points = 0;
  bool withheld = false;
  for (TestOutcome& t : m.tests) {
    const auto ts = std::find_if(spec.tests.begin(), spec.tests.end(), [&](const TestSpec& s) { return s.name == t.name; });
    if (ts != spec.tests.end() && ts->perf && t.status == "passed") {
      t.status = "withheld";
      t.points = 0;
      t.message = reason;
      withheld = true;
    }
    points += t.points;
  }
  if (!withheld) return;
  m.points = points;
  m.status = module_status(m.tests);
  m.detail += (m.detail.empty() ? "" : "; ") + std::string("performance points withheld: ") + reason;
}

std::vector<const ModuleSpec*> used_modules(const Rubric& rubric, const ModuleSpec& m) {
  std::vector<const ModuleSpec*> used;
  std::vector<const ModuleSpec*> todo = {&m};
  for (std::size_t i = 0; i < todo.size(); ++i)
    for (const std::string& id : todo[i]->uses)
      if (const ModuleSpec* u = rubric.find(id); u != nullptr && u != &m &&
                                                  std::find(used.begin(), used.end(), u) == used.end()) {
        used.push_back(u);
        todo.push_back(u);
      }
  return used;
}

std::vector<std::string> readable_include_dirs(const Rubric& rubric, const ModuleSpec& m, const std::string& staged,
                                               const std::string& impl) {
  const fs::path root(staged);
  std::vector<std::string> dirs = {(root / "common" / "include").string(), (root / "common" / "model" / "include").string()};
  std::vector<const ModuleSpec*> own = {&m};
  for (const ModuleSpec* u : used_modules(rubric, m)) own.push_back(u);
  for (const ModuleSpec* x : own)
    dirs.insert(dirs.end(), {(root / "assignments" / x->id).string(), (root / impl / x->id).string()});
  return dirs;
}

std::vector<const ModuleSpec*> with_used_modules(const Rubric& rubric, const std::vector<const ModuleSpec*>& selected) {
  std::vector<const ModuleSpec*> all = selected;
  for (const ModuleSpec* m : selected)
    for (const ModuleSpec* u : used_modules(rubric, *m))
      if (std::find(all.begin(), all.end(), u) == all.end()) all.push_back(u);
  return all;
}

WitnessVerdict read_witness_verdict(const std::string& json_text) {
  WitnessVerdict v;
  try {
    const json j = json::parse(json_text);
    v.fault = j.value("fault", "grader");
    v.problem = j.value("problem", "");
    v.unit = j.value("unit", "");
    v.rate = j.value("rate", 0.0);
    v.output = j.value("output", "");
    if (j.contains("ceiling") && j["ceiling"].is_number() && j.contains("ceiling_name") && j["ceiling_name"].is_string()) {
      const double c = j["ceiling"].get<double>();
      if (c > 0 && std::isfinite(c)) v.ceiling = c, v.ceiling_name = j["ceiling_name"].get<std::string>();
    }
    if (j.contains("shapes") && j["shapes"].is_array()) v.shapes = static_cast<int>(j["shapes"].size());
    if (v.fault.empty() && v.shapes == 0 && !(v.rate > 0 && std::isfinite(v.rate))) {
      v.fault = "grader";
      v.problem = "the witness reported no rate";
    }
  } catch (const std::exception& e) {
    v.fault = "grader";
    v.problem = std::string("no verdict from k2c_witness") + (json_text.empty() ? "" : std::string(": ") + e.what());
  }
  return v;
}

void apply_witness(ModuleOutcome& m, const std::string& test, const WitnessVerdict& v) {
  const auto t = std::find_if(m.tests.begin(), m.tests.end(), [&](const TestOutcome& x) { return x.name == test; });
  if (t == m.tests.end() || !t->perf) return;
  auto void_module = [&](const std::string& why) {
    m.status = "invalid";
    m.detail = test + ": " + why;
    m.points = 0;
    for (TestOutcome& x : m.tests) x.points = 0;
  };
  if (v.fault == "submission") return void_module("the grader's own run of the timed kernel failed: " + v.problem);
  if (v.fault.empty() && v.unit != t->perf->unit) {
    t->perf->not_witnessed = "the witness measures " + v.unit + ", the rubric " + t->perf->unit;
    return;
  }
  if (!v.fault.empty()) {
    t->perf->not_witnessed = v.problem;
    return;
  }
  t->perf->witnessed = v.rate;
  if (t->perf->achieved > v.rate * (1 + kWitnessSlack)) {
    std::ostringstream os;
    os << std::setprecision(4) << "the report says " << t->perf->achieved << " " << v.unit
       << ", the grader's own run of the same kernel reached at most " << v.rate << " " << v.unit
       << ": the report was not written by the course's harness";
    return void_module(os.str());
  }
  // The ratio divides by the report's ceiling, which the report could lower as well as it could
  // raise its rate (or code under test could slow the test program's own measurement of it). Where
  // the checker measured this test's ceiling itself and found it well above the report's, the
  // ratio is taken against the checker's: a lowered ceiling gains nothing, and an honest one
  // measured on a GPU that had slowed down costs some ratio, never the module.
  if (v.ceiling > 0 && v.ceiling_name == t->perf->ceiling_name) {
    t->perf->witnessed_ceiling = v.ceiling;
    if (t->perf->ceiling * (1 + kWitnessSlack) < v.ceiling) {
      std::ostringstream os;
      os << std::setprecision(4) << "taken against the grader's own measurement of " << t->perf->ceiling_name << ", "
         << v.ceiling << " " << v.unit << " (the report's: " << t->perf->ceiling << ")";
      t->perf->ceiling = v.ceiling;
      t->perf->ratio = t->perf->achieved / v.ceiling;
      if (t->status == "passed" && t->perf->ratio < t->perf->required) {
        t->status = "failed";
        t->points = 0;
        t->message = "below the bar, " + os.str();
      } else {
        t->message += (t->message.empty() ? "" : "; ") + os.str();
      }
      retotal(m);
    }
  }
}

void apply_recheck(ModuleOutcome& m, const std::string& test, const WitnessVerdict& v) {
  const auto t = std::find_if(m.tests.begin(), m.tests.end(), [&](const TestOutcome& x) { return x.name == test; });
  if (t == m.tests.end()) return;
  if (v.fault == "grader") {
    t->rechecked = "not checked again: " + v.problem;
    return;
  }
  if (v.fault.empty() && v.shapes > 0) {
    t->rechecked = "checked again at " + std::to_string(v.shapes) + " shapes the grader drew";
    return;
  }
  t->status = "failed";
  t->message = "the grader's own run at shapes it drew: " + v.problem;
  t->rechecked = "failed";
  t->points = 0;
  retotal(m);
}

json find_reference(const std::string& dir, const std::string& gpu, std::string* file) {
  std::error_code ec;
  if (gpu.empty() || gpu == "none" || !fs::is_directory(dir, ec)) return json::object();
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().extension() != ".json") continue;
    try {
      json j = json::parse(read_file(e.path()));
      if (j.value("gpu", "") == gpu) {
        if (file) *file = e.path().string();
        return j;
      }
    } catch (...) {
      // a broken reference file only loses its column, never the grade
    }
  }
  return json::object();
}

GradeReport grade(const GradeOptions& o, std::ostream& progress) {
  const auto grading_began = std::chrono::steady_clock::now();
  // What a run leaves behind in a session of its own becomes the grader's child, so it is found
  // and killed after the run even when it wiped its environment (and with it the run's mark).
  adopt_orphans();
  const Rubric rubric = load_rubric(o.rubric_path);
  std::vector<const ModuleSpec*> selected;
  if (o.modules.empty())
    for (const ModuleSpec& m : rubric.modules) selected.push_back(&m);
  for (const std::string& key : o.modules) {
    const ModuleSpec* m = rubric.find(key);
    if (m == nullptr) {
      std::string known;
      for (const ModuleSpec& k : rubric.modules) known += " " + k.id;
      throw std::runtime_error("unknown module '" + key + "'; the rubric has:" + known);
    }
    if (std::find(selected.begin(), selected.end(), m) == selected.end()) selected.push_back(m);
  }

  // The rubric as loaded: each test run gets a private copy of these bytes (see run_once).
  const std::string rubric_text = read_file(o.rubric_path);
  // Looked at once, before any code under test runs.
  const bool gpu_here = nvidia_device_present();

  GradeReport report;
  report.impl = o.impl;
  report.seed = o.seed;
  report.sanitize = o.sanitize;
  Runner chosen = choose_runner(o);
  const RunsFolder runs(chosen);
  chosen.runs = runs.path();
  const Runner& runner = chosen;
  report.runner = runner.name + (runner.note.empty() ? "" : ": " + runner.note);
  report.temp_folders = runner.temp_folders;
  report.processes = runner.processes;
  report.network = runner.network;
  progress << "code under test runs as " << report.runner << "\n";
  progress << "its /tmp, /var/tmp and /dev/shm: " << report.temp_folders << "; its processes: " << report.processes
           << "; its network: " << report.network << "\n";

  std::string source_root = o.root;
  std::optional<Intake> intake;
  if (!o.submission_dir.empty()) {
    const std::string stage = staging_dir(o.root, o.build_dir);
    // The stage is brought up to date file by file, and the build tree on it keeps what is still
    // current: the next submission recompiles only its own files. That is sound only where code
    // under test could not write the build tree (it ran as another user); where it runs as the
    // grader, a fresh stage makes every object be built again.
    if (runner.uid < 0) fs::remove_all(stage);
    intake = take_submission(rubric, with_used_modules(rubric, selected), o.submission_dir, o.root, stage);
    source_root = intake->staged_root;
    progress << "submission: staged in " << stage << "\n";
    for (const IntakeFile& f : intake->files)
      progress << "submission: " << f.path << ": "
               << (!f.problem.empty() ? f.problem
                                      : f.source.empty() ? "absent (the stub is graded)"
                                                         : "taken from " + f.source)
               << "\n";
    for (const std::string& f : intake->ignored)
      progress << "submission: " << f << ": ignored (not a file the rubric names)\n";
  }
  const fs::path build = intake ? fs::path(o.build_dir) / "build" : fs::path(o.build_dir);
  const int jobs = o.jobs > 0 ? o.jobs : std::max(1u, std::thread::hardware_concurrency());
  // A submission's build tree is the grader's own: one configured from another staging folder
  // (an older grader staged inside the build folder) would refuse the new source, so start over.
  if (intake && fs::exists(build / "CMakeCache.txt") &&
      read_file(build / "CMakeCache.txt").find("CMAKE_HOME_DIRECTORY:INTERNAL=" + source_root + "\n") == std::string::npos)
    fs::remove_all(build);

  // The course tree (and the staged copy) before any code under test runs; compared after
  // every module. Code under test runs with the grader's rights: it could rewrite the rubric,
  // the reference figures or a later module's tests, for this grading and every later one.
  std::vector<TreeWatch> watches;
  const std::vector<std::string> read_by_grading = {o.rubric_path, o.reference_dir};
  watches.emplace_back(o.root,
                       intake ? std::vector<std::string>{o.build_dir, intake->staged_root}
                              : std::vector<std::string>{o.build_dir},
                       read_by_grading);
  if (intake) watches.emplace_back(intake->staged_root, std::vector<std::string>{}, read_by_grading);

  progress << "configuring " << build.string() << " (" << o.impl << ") ...\n" << std::flush;
  std::vector<std::string> configure = {"cmake", "-S", source_root, "-B", build.string(),
                                        "-DK2C_IMPL=" + o.impl};
  if (!o.generator.empty() && !fs::exists(build / "CMakeCache.txt"))
    configure.insert(configure.end(), {"-G", o.generator});
  // A submission's files compile as the runner (compile_as, through CMake's compiler launcher):
  // what they #include or embed is read with its rights, not the grader's. Empty, and so cleared
  // from the cache, where code under test runs as the grader, or the tree graded is the grader's.
  // The runner must read the staged tree and run the compilers the build found (not a course
  // checked out under umask 077, not a toolkit under /root): where it cannot, the files compile as
  // the grader, as the report says.
  std::string compile_as, compile_as_blocked;
  const std::string self_exe = fs::read_symlink("/proc/self/exe").string();
  if (intake && runner.uid >= 0) {
    if (const std::string hidden = hidden_from_others(intake->staged_root); !hidden.empty())
      compile_as_blocked = runner.name + " cannot read " + hidden;
    else if (self_exe.find(';') != std::string::npos)  // CMake would split the launcher there
      compile_as_blocked = "the grader's path holds a ';' (" + self_exe + ")";
    else
      compile_as = self_exe + ";compile-as;" + std::to_string(runner.uid) + ";" + std::to_string(runner.gid) + ";--";
  }
  configure.push_back("-DK2C_COMPILE_AS=" + compile_as);
  ProcessResult conf = run_process(configure, {.env = build_env(build), .timeout_s = 900});
  if (const std::string far = compilers_out_of_reach(build); conf.exit_code == 0 && !compile_as.empty() && !far.empty()) {
    configure.back() = "-DK2C_COMPILE_AS=";
    conf = run_process(configure, {.env = build_env(build), .timeout_s = 900});
    compile_as_blocked = runner.name + " cannot run " + far;
  }
  // Configuring reads the course alone (a submission's files are only compiled, later): where it
  // fails, the machine or the course is at fault, and a "build failed" for every module would
  // read as the student's zero.
  if (conf.exit_code != 0)
    throw std::runtime_error("CMake could not configure the course in " + build.string() +
                             " (the machine or the course, not a submission, is at fault):\n" +
                             compiler_errors(conf.output));
  if (!compile_as_blocked.empty()) {
    report.runner += "; the submission's files compile as the grader: " + compile_as_blocked;
    progress << "the submission's files compile as the grader: " << compile_as_blocked << "\n";
  }
  json build_info = json::object();
  try {
    build_info = json::parse(read_file(build / "k2c_build_info.json"));
  } catch (...) {
  }

  // The grader's own runs of timed kernels (k2c_witness, k2c/testing/witness.h), built once before
  // any code under test runs and kept as built: its bytes are compared before every use, since the
  // build tree is not part of the course's fingerprint.
  // Under --sanitize too: a report's passes are no more to be trusted there (the sanitizer is
  // another check, not a replacement for these).
  const bool witnessing = gpu_here &&
                          std::any_of(selected.begin(), selected.end(), [](const ModuleSpec* s) {
                            return s->kind != "cpu" && std::any_of(s->tests.begin(), s->tests.end(), [](const TestSpec& t) {
                                     return !t.witness.empty() || (t.perf && !t.perf->witness.empty());
                                   });
                          });
  const Checker witness =
      witnessing ? build_checker(build, "k2c_witness", "the grader's own runs of timed kernels", jobs, progress) : Checker{};
  // The grader's own check of distributed correctness tests (k2c_rank_witness), likewise: it needs
  // no GPU, and holds no student code either.
  const bool rank_witnessing =
      std::any_of(selected.begin(), selected.end(), [](const ModuleSpec* s) {
        return std::any_of(s->tests.begin(), s->tests.end(), [](const TestSpec& t) { return !t.rank_witness.empty(); });
      });
  const Checker rank_witness =
      rank_witnessing ? build_checker(build, "k2c_rank_witness", "the grader's own checks of distributed tests", jobs, progress)
                      : Checker{};

  for (std::size_t i = 0; i < selected.size(); ++i) {
    const ModuleSpec& spec = *selected[i];
    const std::string tag = "[" + std::to_string(i + 1) + "/" + std::to_string(selected.size()) + "] " + spec.id;
    ModuleOutcome m;
    m.id = spec.id;
    m.title = spec.title;
    m.max_points = spec.points();
    auto finish = [&](ModuleOutcome out) {
      progress << progress_line(tag, out) << "\n" << std::flush;
      report.modules.push_back(std::move(out));
      // Nothing graded after a rewrite of the course can be trusted, nor can the course itself
      // for the next submission: stop, naming what changed.
      for (const TreeWatch& w : watches) {
        const std::vector<std::string> changed = w.changes();
        if (changed.empty()) continue;
        std::string list;
        for (std::size_t k = 0; k < changed.size() && k < 10; ++k) list += (k ? ", " : "") + changed[k];
        if (changed.size() > 10) list += " and " + std::to_string(changed.size() - 10) + " more";
        throw std::runtime_error("the course tree " + w.root() + " changed while grading " + spec.id + ": " +
                                 list + ". Grading stopped: later modules and submissions would be graded " +
                                 "against the rewritten files. Restore them (git checkout, or a fresh copy) " +
                                 "before grading again.");
      }
      if (o.after_module) o.after_module(report);
    };

    if (o.deadline_s > 0 &&
        std::chrono::duration<double>(std::chrono::steady_clock::now() - grading_began).count() >= o.deadline_s) {
      m.status = "not graded";
      m.detail = "grading's time (--deadline " + std::to_string(static_cast<long long>(o.deadline_s)) +
                 " s) ran out before this module began";
      finish(m);
      continue;
    }
    if (intake && !intake->problem_for(spec).empty()) {
      m.status = "refused";
      m.detail = "submission " + intake->problem_for(spec);
      finish(m);
      continue;
    }
    const auto& built = build_info.value("modules", json::array());
    if (std::find(built.begin(), built.end(), spec.id) == built.end()) {
      m.status = "skipped";
      m.detail = not_built_reason(spec, source_root, build_info);
      finish(m);
      continue;
    }

    progress << tag << ": building ...\n" << std::flush;
    const ProcessResult b = run_process(
        {"cmake", "--build", build.string(), "--target", "k2c_test_" + spec.id, "-j", std::to_string(jobs)},
        {.env = build_env(build), .timeout_s = 1800});
    // A build stopped at its limit can leave compiles running (k2c compile-as, as root, below a
    // shell of Ninja's; the student's files compiling as the runner below it): everything below
    // the grader is killed, whoever it runs as, then what their scratch folders held.
    kill_descendants();
    clear_compile_scratch(build / "compile-scratch");
    if (b.exit_code != 0) {
      m.status = "build failed";
      m.detail = build_failure_detail(b.output);
      m.log = b.output;
      finish(m);
      continue;
    }
    if (o.build_only) {
      m.status = "skipped";
      m.detail = "built, not run (--build-only)";
      finish(m);
      continue;
    }

    // What the student's files read at build time: every header of the implementation's
    // translation units must come from the module's own folder, the harness's public headers,
    // or the compilers' and toolkits' folders. Anything else (the reference solution reached by
    // an absolute path or by `../` climbing out of the staging tree, a test's internals) is
    // refused, from the records the build itself wrote (either generator).
    // The modules this one links are checked the same way, each against its own folders: their
    // headers are this module's to read, and their code runs inside its tests.
    const std::vector<const ModuleSpec*> used = used_modules(rubric, spec);
    if (intake) {
      const fs::path staged(intake->staged_root);
      std::string problem;
      std::vector<const ModuleSpec*> checked = {&spec};
      checked.insert(checked.end(), used.begin(), used.end());
      for (const ModuleSpec* c : checked) {
        const TargetDeps deps = target_dependencies(build.string(), "k2c_impl_" + c->id);
        const std::vector<std::string> readable = readable_include_dirs(rubric, *c, staged.string(), o.impl);
        if (deps.target_found && !deps.error.empty())
          problem = "cannot check what it includes: " + deps.error;
        else if (deps.target_found)
          problem = include_outside(deps, readable, system_include_dirs(build.string()), {o.root, staged.string(), o.build_dir});
        if (!problem.empty()) break;
      }
      if (!problem.empty()) {
        // Shown relative to the staging tree, where the student's files have their rubric paths.
        for (auto at = problem.find(staged.string() + "/"); at != std::string::npos; at = problem.find(staged.string() + "/"))
          problem.erase(at, staged.string().size() + 1);
        m.status = "refused";
        m.detail = "build refused: " + problem + (problem.rfind("cannot", 0) == 0 ? "" : " outside the submission");
        finish(m);
        continue;
      }
    }
    auto linked_by = [&](const ModuleSpec& x) {  // the implementations x may link: those of the modules it uses
      std::vector<std::string> names;
      for (const ModuleSpec* u : used_modules(rubric, x)) names.push_back("libk2c_impl_" + u->id + ".so");
      return names;
    };
    // A weak reference is a link the link check does not see, and a loader call one made at run
    // time: either can reach MPI, NCCL or cuBLAS and have them compute the module's results, not
    // only time them. Refused, with the modules it links.
    {
      std::string refusal;
      std::vector<const ModuleSpec*> libraries = {&spec};
      libraries.insert(libraries.end(), used.begin(), used.end());
      for (const ModuleSpec* c : libraries) {
        const fs::path lib = impl_library(build, c->id);
        if (lib.empty() || !refusal.empty()) continue;
        const LibraryFindings f = inspect_library(lib.string());
        std::string p = weak_reference_problem(f);
        if (p.empty() && !loader_calls(f).empty()) p = runtime_loading_problem(f, linked_by(*c));
        if (!p.empty()) refusal = (c == &spec ? "" : c->id + ": ") + p;
      }
      if (!refusal.empty()) {
        m.status = "refused";
        m.detail = "build refused: " + refusal;
        finish(m);
        continue;
      }
    }
    // What it may load at run time, read from the built library: the link check (no undefined
    // symbols) says nothing about a library opened with dlopen() once the tests are running.
    std::string loading;
    if (const fs::path lib = impl_library(build, spec.id); !lib.empty())
      loading = runtime_loading_problem(inspect_library(lib.string()), linked_by(spec));
    for (const ModuleSpec* u : used)
      if (const fs::path lib = impl_library(build, u->id); !lib.empty())
        if (const std::string p = runtime_loading_problem(inspect_library(lib.string()), linked_by(*u)); !p.empty())
          loading += (loading.empty() ? "" : "; ") + u->id + ": " + p;

    const double timeout = o.timeout_s > 0 ? o.timeout_s : spec.timeout_s;
    const fs::path program = build / "bin" / ("k2c_test_" + spec.id);
    std::vector<std::pair<std::string, std::string>> env = {
        {"K2C_SEED", std::to_string(o.seed)},
        {"K2C_SANITIZE", o.sanitize ? "1" : "0"}};
    // One launch of the test program; returns its verdict and leaves its report in gtest_json.
    std::string gtest_json;
    auto run_once = [&](const std::vector<std::string>& prefix, const std::string& suffix,
                        const std::vector<std::pair<std::string, std::string>>& extra_env,
                        const ModuleSpec& part, const std::string& filter, bool nccl_run = true) {
      // The run's own folder (working directory, HOME, report), the runner's; the report is kept
      // in the build tree afterwards, for whoever wants to read it.
      const RunFolder folder(runner);
      const fs::path json_path = folder.path() / "report.json";
      const fs::path kept = build / "reports" / (spec.id + suffix + ".json");
      fs::create_directories(kept.parent_path());
      fs::remove(kept);
      std::vector<std::string> cmd = prefix;
      cmd.push_back(program.string());
      cmd.push_back("--gtest_output=json:" + json_path.string());
      if (!filter.empty()) cmd.push_back("--gtest_filter=" + filter);
      // The rubric the test reads its thresholds from, as a read-only copy for this run alone:
      // code under test as another user cannot rewrite it, and as the grader's own user (who
      // can) it reaches no later run, module or submission.
      const PrivateCopy rubric_copy(rubric_text, runner.runs, "k2c-rubric-", ".json");
      auto all_env = env;
      all_env.emplace_back("K2C_RUBRIC", rubric_copy.path());
      all_env.emplace_back("HOME", folder.path().string());
      // Its temporary files in its own folder too: what an earlier run left in /tmp (a plain file
      // where Open MPI makes its session directory, say, which stops every later mpirun of the
      // same account) is never in the way of this one, and nothing it leaves there reaches a later one.
      all_env.emplace_back("TMPDIR", folder.path().string());
      // This run's mark, which its descendants inherit: what is still running with it afterwards
      // is killed, and nothing else of the same user.
      const std::string run_mark = folder.path().filename().string();
      all_env.emplace_back("K2C_RUN", run_mark);
      all_env.insert(all_env.end(), extra_env.begin(), extra_env.end());
      const ProcessResult r = run_process(
          cmd, {.env = all_env,
                .cwd = folder.path().string(),
                .timeout_s = timeout,
                .uid = runner.uid,
                .gid = runner.gid,
                .private_tmp = runner.private_tmp,
                .private_pids = runner.private_pids,
                .private_net = runner.private_net});
      // Whatever it left running, detached from its process group, dies before the next run.
      if (runner.uid >= 0) kill_run_leftovers(runner.uid, run_mark);
      gtest_json = read_report(json_path);
      if (!gtest_json.empty()) std::ofstream(kept) << gtest_json;
      // The device files may appear only once a first program has started CUDA (nvidia-modprobe
      // without udev rules): looked for again before a report is judged as from a machine without.
      ModuleOutcome out =
          evaluate_module(part, r, gtest_json, o.impl, timeout, gpu_here || nvidia_device_present(), nccl_run);
      if (o.sanitize) {  // the sanitizer's own verdict, for the record
        const auto at = r.output.rfind("ERROR SUMMARY:");
        if (at != std::string::npos)
          out.detail += (out.detail.empty() ? "" : "; ") + std::string("compute-sanitizer ") +
                        r.output.substr(at, r.output.find('\n', at) - at);
      }
      return out;
    };

    const bool has_cuda_parts = std::any_of(spec.files.begin(), spec.files.end(), [](const std::string& f) {
      return f.size() > 3 && f.compare(f.size() - 3, 3, ".cu") == 0;
    });
    if (spec.kind == "mpi") {
      // Every run the rubric lists, started as `k2c run` starts ranks (launch.h); the module's
      // verdict combines them.
      std::vector<std::string> labels;
      for (const RunSpec& rs : spec.runs) labels.push_back(rs.label());
      const auto runs = run_until_void(labels, [&](std::size_t k) {
        const RunSpec& rs = spec.runs[k];
        progress << tag << ": running on " << rs.label() << " (time limit " << timeout << " s) ...\n" << std::flush;
        Launch l = mpirun_prefix(
            {.ranks = rs.ranks, .backend = rs.backend, .dist_timeout_s = std::max(10, static_cast<int>(timeout / 3))});
        // A distributed module's CUDA parts (19's decode kernel) are tested in its one-rank run:
        // under --sanitize that run goes through compute-sanitizer too.
        if (o.sanitize && rs.ranks == 1 && has_cuda_parts) l.argv.insert(l.argv.end(), kSanitizer.begin(), kSanitizer.end());
        return run_once(l.argv, "." + rs.backend + std::to_string(rs.ranks), l.env, spec, "", rs.backend == "nccl");
      });
      m = combine_runs(spec, runs);
    } else {
      std::vector<std::string> prefix;
      if (o.sanitize && spec.kind == "gpu") prefix = kSanitizer;
      progress << tag << ": running (time limit " << timeout << " s) ...\n" << std::flush;
      if (std::any_of(spec.tests.begin(), spec.tests.end(), [](const TestSpec& t) { return t.bonus; })) {
        const ModuleSpec main = main_part(spec), bonus = bonus_part(spec);
        std::string bonus_names;
        for (const TestSpec& t : bonus.tests) bonus_names += (bonus_names.empty() ? "" : ":") + t.name;
        const auto runs = run_until_void({"main", "bonus"}, [&](std::size_t k) {
          if (k == 0) return run_once(prefix, "", {}, main, "-" + bonus_names);
          progress << tag << ": running the bonus tests (time limit " << timeout << " s) ...\n" << std::flush;
          return run_once(prefix, ".bonus", {}, bonus, bonus_names);
        });
        m = merge_bonus(spec, runs[0].second, runs[1].second);
      } else {
        m = run_once(prefix, "", {}, spec, "");
      }
    }

    if (!loading.empty()) withhold_performance(m, spec, loading);

    // The module's checks below share one time limit, the module's own. Each check is bounded by
    // its checker, but a submission that passes its runs and then stalls every check would cost
    // that bound once per checked test (hours over a course); past the limit, a check not yet run
    // counts as failed by the submission, as the one that stalled did.
    const auto checks_began = std::chrono::steady_clock::now();
    const double checks_limit = std::max(timeout, 60.0);
    auto out_of_time = [&](WitnessVerdict& v) {
      const double spent = std::chrono::duration<double>(std::chrono::steady_clock::now() - checks_began).count();
      if (spent <= checks_limit) return false;
      v.fault = "submission";
      v.problem = "not run: this module's checks took " + std::to_string(static_cast<int>(spent)) +
                  " s, past its time limit of " + std::to_string(static_cast<int>(checks_limit)) + " s";
      return true;
    };

    // The grader's own run of each witnessed kernel whose test passed (with figures, for a
    // performance test): the report came from a process that holds the student's code, and so
    // could have been written by it.
    if (witnessing && spec.kind != "cpu")
      for (const TestSpec& ts : spec.tests) {
        const bool timed = ts.perf && !ts.perf->witness.empty();
        if ((!timed && ts.witness.empty()) || voids_module(m)) continue;
        const auto t = std::find_if(m.tests.begin(), m.tests.end(), [&](const TestOutcome& x) { return x.name == ts.name; });
        if (t == m.tests.end() || t->status != "passed" || (timed && !t->perf)) continue;
        if (!witness.problem.empty()) {
          if (timed) t->perf->not_witnessed = witness.problem;
          else t->rechecked = "not checked again: " + witness.problem;
          continue;
        }
        witness.check_unchanged(spec.id);
        if (WitnessVerdict late; out_of_time(late)) {
          if (timed) {
            progress << tag << ": " << ts.name << ": " << late.problem << "\n" << std::flush;
            apply_witness(m, ts.name, late);
          } else {
            record_recheck(m, ts.name, "k2c_witness", late, tag, progress);
          }
          continue;
        }
        if (!timed) {
          progress << tag << ": the grader's own check of " << ts.name << " at " << kRecheckShapes
                   << " shapes it draws ...\n" << std::flush;
          record_recheck(m, ts.name, "k2c_witness",
                         run_witness(witness.bin, ts.witness, program, runner, timeout, kRecheckShapes, ""), tag, progress);
          continue;
        }
        progress << tag << ": the grader's own run of " << ts.name << " ...\n" << std::flush;
        const WitnessVerdict v = run_witness(witness.bin, ts.perf->witness, program, runner, timeout, 0, ts.perf->ceiling);
        if (v.fault.empty()) {
          std::ostringstream os;
          os << std::setprecision(4) << tag << ": " << ts.name << ": the report says " << t->perf->achieved << " "
             << v.unit << ", the grader's own run saw " << v.rate << "\n";
          progress << os.str() << std::flush;
        } else {
          progress << tag << ": " << ts.name << ": " << (v.fault == "grader" ? "not witnessed: " : "") << v.problem << "\n"
                   << std::flush;
        }
        if (v.fault == "submission") m.log += "\n[k2c_witness] " + v.problem + "\n" + v.output;
        apply_witness(m, ts.name, v);
      }

    // The same for a distributed module's correctness tests, on its ranks (k2c/dist/rank_witness.h).
    if (rank_witnessing && spec.kind == "mpi")
      for (const TestSpec& ts : spec.tests) {
        if (ts.rank_witness.empty() || voids_module(m)) continue;
        const auto t = std::find_if(m.tests.begin(), m.tests.end(), [&](const TestOutcome& x) { return x.name == ts.name; });
        if (t == m.tests.end() || t->status != "passed") continue;
        const int ranks = ts.rank_witness_ranks > 0 ? ts.rank_witness_ranks : rank_witness_ranks(spec);
        if (!rank_witness.problem.empty() || ranks < 1) {
          t->rechecked = "not checked again: " + (ranks < 1 ? "the rubric runs this module on no MPI ranks"
                                                             : rank_witness.problem);
          continue;
        }
        rank_witness.check_unchanged(spec.id);
        if (WitnessVerdict late; out_of_time(late)) {
          record_recheck(m, ts.name, "k2c_rank_witness", late, tag, progress);
          continue;
        }
        progress << tag << ": the grader's own check of " << ts.name << " on " << ranks << " ranks, "
                 << kRecheckShapes << " cases it draws ...\n" << std::flush;
        Launch l = mpirun_prefix({.ranks = ranks, .backend = "mpi", .dist_timeout_s = std::max(10, static_cast<int>(timeout / 3))});
        l.argv.insert(l.argv.end(), {"-x", "K2C_RANK_WITNESS", "-x", "K2C_RUN", program.string(),
                                     "--k2c_rank_witness=" + ts.rank_witness});
        record_recheck(m, ts.name, "k2c_rank_witness",
                       run_rank_witness(rank_witness.bin, ts.rank_witness, l, ranks, runner, timeout, kRecheckShapes), tag,
                       progress);
      }

    if (!gtest_json.empty()) {
      try {
        const json j = json::parse(gtest_json);
        const std::string gpu = global_property(j, "k2c_gpu");
        // A module's runs on the CPU backend report no device: they do not undo a GPU another
        // module (or another run) saw.
        if (gpu == "none" && (report.gpu.empty() || report.gpu == "none")) {
          report.gpu = gpu;
          report.gpu_reason = global_property(j, "k2c_gpu_reason");
        } else if (!gpu.empty() && gpu != "none") {
          report.gpu = gpu;
          report.gpu_reason.clear();
        }
        const std::string rt = global_property(j, "k2c_cuda_runtime");
        if (!rt.empty()) report.cuda_runtime = rt;
      } catch (...) {
      }
    }
    finish(m);
  }

  // Reference figures for this GPU, and the ceilings this run measured.
  const json ref = find_reference(o.reference_dir, report.gpu, &report.reference_file);
  for (ModuleOutcome& m : report.modules)
    for (TestOutcome& t : m.tests) {
      if (!t.perf) continue;
      report.ceilings[t.perf->ceiling_name] = {t.perf->ceiling, t.perf->unit};
      const json* r = nullptr;
      if (ref.contains("modules") && ref["modules"].contains(m.id) && ref["modules"][m.id].contains(t.name))
        r = &ref["modules"][m.id][t.name];
      if (r && r->contains("ratio") && (*r)["ratio"].is_number()) t.perf->reference_ratio = (*r)["ratio"].get<double>();
    }
  return report;
}

}  // namespace k2c::grader
