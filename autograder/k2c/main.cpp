// main.cpp — the k2c command line: grade, info, ceilings, bench, handout.
//
//   k2c grade [--impl assignments|solutions] [--modules 00,01] [--submission DIR] [--seed N]
//             [--timeout S] [--sanitize] [--json FILE] [--gradescope FILE] [--deadline S] [--write-reference FILE]
//   k2c info                 devices, toolkit, and what can be graded here
//   k2c ceilings [--json F]  the ceilings every threshold is measured against, on this GPU
//   k2c bench [--filter RE]  every module's Google Benchmark sweep, JSON under build/bench/
//   k2c collectives [-np N] [--backend B] [-b -e -f -n -w -c -o]   module 11's nccl-tests-style sweep
//   k2c run -np N [--backend mpi|nccl] [--timeout S] PROGRAM [ARGS...]
//                            start ranks: prints the plain mpirun command, then runs it
//   k2c train --data DIR ... the single-process trainer (k2c_train; `k2c train --help`)
//   k2c handout OUT          a student tree without solutions/ that builds and grades
//
// Exit status: 0 when grading ran (whatever the score), 2 for errors in the grader's own input
// (a malformed rubric, an unknown module, a bad submission directory), 1 for other failures.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <set>
#include <sstream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "grade.h"
#include "intake.h"
#include "launch.h"
#include "k2c/core/rubric.h"
#include "process.h"

namespace fs = std::filesystem;
using nlohmann::json;
using namespace k2c::grader;

namespace {

fs::path self_dir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::current_path() : exe.parent_path();
}

// Whether this k2c was configured with a CUDA toolkit, which builds k2c_probe with it.
#ifdef K2C_BUILT_WITH_CUDA
constexpr bool kBuiltWithCuda = true;
#else
constexpr bool kBuiltWithCuda = false;
#endif

bool on_path(const std::string& program) {
  const ProcessResult r = run_process({"sh", "-c", "command -v " + program}, {.timeout_s = 10});
  return r.exit_code == 0;
}

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

// A flag's value that cannot be used, found before any work starts: status 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// That an output file given by `option` can be made, before hours of grading go into it: its
// folder made, a file beside it created and removed.
void check_can_write(const std::string& path, const std::string& option) {
  if (path.empty()) return;
  const fs::path p(path);
  std::error_code ec;
  if (p.has_parent_path()) fs::create_directories(p.parent_path(), ec);
  if (ec) throw UsageError(option + " " + path + ": cannot make its folder: " + ec.message());
  if (fs::is_directory(p, ec)) throw UsageError(option + " " + path + ": a folder, not a file");
  const std::string probe = path + ".part";
  if (!std::ofstream(probe)) throw UsageError(option + " " + path + ": cannot write there");
  fs::remove(probe, ec);
}

// Written beside the destination and renamed over it, so that a grader stopped mid-write (grading
// writes its results after every module) leaves the previous whole file, never a cut one.
void write_json(const std::string& path, const json& j) {
  if (path.empty()) return;
  if (fs::path(path).has_parent_path()) fs::create_directories(fs::path(path).parent_path());
  const std::string part = path + ".part";
  {
    std::ofstream out(part);
    // Text from outside the grader reaches a report through valid_utf8 (process.h) or the JSON
    // parser; the replacing handler is the backstop, so that a byte missed cannot cost the report.
    out << j.dump(2, ' ', false, json::error_handler_t::replace) << "\n";
    if (!out.flush()) throw std::runtime_error("cannot write " + part);
  }
  std::error_code ec;
  fs::rename(part, path, ec);
  if (ec) throw std::runtime_error("cannot write " + path + ": " + ec.message());
}

// The probe is a small CUDA program built wherever the build has a CUDA toolkit (make build, make
// test; not make grade, which builds k2c alone), beside it in <build>/bin
// (CMAKE_RUNTIME_OUTPUT_DIRECTORY); the grader itself never touches the GPU.
json run_probe(bool ceilings, std::string* error) {
  const fs::path probe = self_dir() / "k2c_probe";
  if (!fs::exists(probe)) {
    *error = kBuiltWithCuda ? "k2c_probe is not built (build it with: cmake --build " +
                                  self_dir().parent_path().string() + " --target k2c_probe)"
                            : "this build has no CUDA toolkit (nvcc was not found when it was configured, "
                              "or -DK2C_CUDA=OFF)";
    return json();
  }
  std::vector<std::string> cmd = {probe.string()};
  if (ceilings) cmd.push_back("--ceilings");
  const ProcessResult r = run_process(cmd, {.timeout_s = 600});
  try {
    if (r.exit_code == 0) return json::parse(r.output);
  } catch (...) {
  }
  *error = "k2c_probe failed (" + describe_exit(r, 600) + "): " + first_line(r.output);
  return json();
}

// Prints the command, then replaces this process with it, so the ranks' output streams as it
// runs and the exit status is mpirun's.
[[noreturn]] void exec_launch(const Launch& l) {
  std::cerr << "k2c run: " << l.display() << std::endl;
  for (const auto& [k, v] : l.env) setenv(k.c_str(), v.c_str(), 1);
  std::vector<std::string> args = l.argv;
  std::vector<char*> argv_c;
  for (std::string& a : args) argv_c.push_back(a.data());
  argv_c.push_back(nullptr);
  execvp(argv_c[0], argv_c.data());
  throw std::runtime_error("cannot run " + args[0] + ": " + std::strerror(errno) +
                           " (Open MPI's mpirun must be on PATH: make deps)");
}

// The top-level names of what git would hand over from `root` (files it tracks, and new ones it
// does not ignore); empty when `root` is no git checkout or git is missing.
std::set<std::string> git_top_level(const fs::path& root) {
  const ProcessResult r = run_process({"git", "-C", root.string(), "ls-files", "-z", "--cached", "--others", "--exclude-standard"},
                                      {.timeout_s = 60, .keep_head = std::size_t{1} << 26});
  std::set<std::string> names;
  if (r.exit_code != 0 || r.output_bytes > r.output.size()) return names;
  std::istringstream paths(r.output);
  for (std::string path; std::getline(paths, path, '\0');)
    if (!path.empty()) names.insert(path.substr(0, path.find('/')));
  return names;
}

void copy_handout(const fs::path& root, const fs::path& out) {
  std::error_code ec;
  if (fs::exists(out) && !fs::is_empty(out, ec))
    throw std::runtime_error("handout: " + out.string() + " exists and is not empty");
  copy_course(root.string(), out.string());
  // In a git checkout, what git ignores or never saw at the top (an instructor's scratch files and
  // folders, generated data) stays behind: it could hold anything, solutions included.
  if (const std::set<std::string> shipped = git_top_level(root); !shipped.empty())
    for (const auto& entry : fs::directory_iterator(out))
      if (!shipped.count(entry.path().filename().string())) fs::remove_all(entry.path());
  // Students get their own README: the course's speaks of grading the solutions, which a handout
  // does not ship.
  if (const fs::path students = root / "docs" / "README.handout.md"; fs::exists(students))
    fs::copy_file(students, out / "README.md", fs::copy_options::overwrite_existing);
}

}  // namespace

int main(int argc, char** argv) {
  // The compiler launcher of a submission's files (compile_as in process.h), as the build runs it:
  // everything after `--` is the compiler's command, read here before CLI11 sees any of it.
  if (argc >= 5 && std::string(argv[1]) == "compile-as" && std::string(argv[4]) == "--") {
    try {
      return compile_as(std::stoi(argv[2]), std::stoi(argv[3]), std::vector<std::string>(argv + 5, argv + argc));
    } catch (const std::exception& e) {
      std::cerr << "k2c compile-as: " << e.what() << "\n";
      return 1;
    }
  }
  // `-np N`, as mpirun and nccl-tests users type it, is `--np N` to CLI11 (single-dash options
  // are one letter there).
  std::vector<std::string> arg_store(argv, argv + argc);
  // After `run`, only k2c's own options are rewritten: the program's arguments are its own.
  bool in_run = false;
  for (std::size_t i = 1; i < arg_store.size(); ++i) {
    std::string& a = arg_store[i];
    const bool joined = a.rfind("--np=", 0) == 0 || a.rfind("--backend=", 0) == 0 || a.rfind("--timeout=", 0) == 0;
    if (in_run && joined) continue;  // an option with its value in one word
    if (in_run && a != "-np" && a != "--np" && a != "--backend" && a != "--timeout") break;
    if (a == "-np") a = "--np";
    if (in_run) ++i;  // skip the option's value
    if (a == "run") in_run = true;
  }
  std::vector<char*> arg_ptrs;
  for (std::string& a : arg_store) arg_ptrs.push_back(a.data());
  argv = arg_ptrs.data();

  CLI::App app{"k2c — the Kernels to Clusters grader"};
  app.require_subcommand(1);
  std::string root = K2C_SOURCE_DIR;
  app.add_option("--root", root, "course source tree")->check(CLI::ExistingDirectory);

  // ---- grade
  GradeOptions g;
  std::string modules_csv, json_out, gradescope_out, reference_out;
  std::uint64_t seed = 0;
  auto* grade_cmd = app.add_subcommand("grade", "build and grade modules");
  grade_cmd->add_option("--impl", g.impl, "tree to grade")->check(CLI::IsMember({"assignments", "solutions"}));
  grade_cmd->add_option("--modules", modules_csv, "comma-separated ids or numbers (default: all)");
  grade_cmd->add_option("--submission", g.submission_dir, "grade a student's files from DIR")->check(CLI::ExistingDirectory);
  auto* seed_opt = grade_cmd->add_option("--seed", seed, "seed for random shapes and inputs (default: random)");
  grade_cmd->add_option("--timeout", g.timeout_s, "per-module time limit in seconds (default: rubric)");
  grade_cmd->add_flag("--sanitize", g.sanitize, "run GPU tests under compute-sanitizer memcheck (no timing)");
  grade_cmd->add_flag("--build-only", g.build_only,
                      "build the checkers and each module's test program, run nothing (a later grade into "
                      "the same --build-dir recompiles only what changed)");
  grade_cmd->add_option("--json", json_out, "write the full report as JSON");
  grade_cmd->add_option("--gradescope", gradescope_out, "write Gradescope's results.json");
  grade_cmd->add_option("--deadline", g.deadline_s,
                        "seconds after which no further module begins (the rest: not graded); set it below "
                        "the grading platform's own time limit by the longest module's time");
  grade_cmd->add_option("--write-reference", reference_out, "write this run's figures as reference timings");
  grade_cmd->add_option("--build-dir", g.build_dir, "build tree (default: <root>/build/<impl>)");
  grade_cmd->add_option("--rubric", g.rubric_path, "rubric (default: <root>/autograder/rubric.json)");
  grade_cmd->add_option("--generator", g.generator, "CMake generator for a new build tree");
  grade_cmd->add_option("-j,--jobs", g.jobs, "parallel build jobs");
  grade_cmd->add_option("--run-as", g.run_as,
                        "as root: the user test programs run as (default nobody; 'self' keeps root)");

  auto* info_cmd = app.add_subcommand("info", "devices, toolkit, and what can be graded here");
  std::string ceilings_json;
  auto* ceilings_cmd = app.add_subcommand("ceilings", "measure copy bandwidth, fp32 peak, cuBLAS rates");
  ceilings_cmd->add_option("--json", ceilings_json, "also write them as JSON");
  std::string bench_filter = ".", bench_dir;
  auto* bench_cmd = app.add_subcommand("bench", "run every module's benchmark sweep");
  bench_cmd->add_option("--filter", bench_filter, "Google Benchmark filter regex");
  bench_cmd->add_option("--out", bench_dir, "directory for the JSON results (default: <build>/bench)");
  bench_cmd->add_option("--build-dir", g.build_dir, "build tree holding the benchmarks");
  LaunchOptions coll_launch{.ranks = 2};
  auto* coll_cmd = app.add_subcommand("collectives",
      "module 11's nccl-tests-style sweep: k2c collectives [-np N] [--backend mpi|nccl] [-b 1M -e 1G -f 2 -n 20 -w 5 -c 1 -o out.json]");
  coll_cmd->add_option("--np", coll_launch.ranks, "number of ranks (one GPU each for NCCL); -np also works");
  coll_cmd->add_option("--backend", coll_launch.backend, "mpi (CPU ranks) or nccl (one GPU a rank); default: the machine's")
      ->check(CLI::IsMember({"mpi", "nccl"}));
  coll_cmd->add_option("--build-dir", g.build_dir, "build tree holding k2c_collectives");
  coll_cmd->allow_extras();
  LaunchOptions launch;
  auto* run_cmd = app.add_subcommand("run",
      "start a program on N ranks: k2c run -np N [--backend mpi|nccl] PROGRAM [ARGS...] (prints the mpirun command)");
  run_cmd->add_option("--np", launch.ranks, "number of ranks (one GPU each for NCCL); -np also works");
  run_cmd->add_option("--backend", launch.backend, "mpi (CPU ranks) or nccl (one GPU a rank); default: the machine's")
      ->check(CLI::IsMember({"mpi", "nccl"}));
  run_cmd->add_option("--timeout", launch.dist_timeout_s, "seconds any rank waits on its peers before the job ends (K2C_DIST_TIMEOUT)");
  // Everything from the first word that is not one of these options on is the program's.
  run_cmd->prefix_command();
  auto* train_cmd = app.add_subcommand("train",
      "train the course's transformer in one process: k2c train --data datasets/markov [...] (k2c_train --help)");
  train_cmd->prefix_command();
  train_cmd->set_help_flag();  // --help is k2c_train's own
  std::string handout_dir;
  auto* handout_cmd = app.add_subcommand("handout", "write a student tree without solutions/");
  handout_cmd->add_option("out", handout_dir, "destination directory")->required();

  CLI11_PARSE(app, argc, argv);
  root = fs::absolute(root).string();
  if (g.build_dir.empty()) g.build_dir = (fs::path(root) / "build" / g.impl).string();
  g.build_dir = fs::absolute(g.build_dir).string();

  try {
    if (*grade_cmd) {
      g.root = root;
      if (g.rubric_path.empty()) g.rubric_path = (fs::path(root) / "autograder" / "rubric.json").string();
      g.reference_dir = (fs::path(root) / "autograder" / "reference").string();
      std::stringstream csv(modules_csv);
      for (std::string m; std::getline(csv, m, ',');) {
        m.erase(0, m.find_first_not_of(" \t"));
        m.erase(m.find_last_not_of(" \t") + 1);
        if (!m.empty()) g.modules.push_back(m);
      }
      if (!modules_csv.empty() && g.modules.empty())
        throw UsageError("--modules '" + modules_csv + "' names no module (leave it out to grade them all)");
      if (g.timeout_s < 0) throw UsageError("--timeout: seconds above 0 (0 or none: the rubric's limits)");
      if (g.deadline_s < 0) throw UsageError("--deadline: seconds, 0 or more");
      check_can_write(json_out, "--json");
      check_can_write(gradescope_out, "--gradescope");
      check_can_write(reference_out, "--write-reference");
      g.seed = *seed_opt ? seed : std::random_device{}() % 1000000;
      // The results so far after each module, marked unfinished; the last write is the whole run.
      // Best effort: a file that cannot be written now stops nothing (the final write still must).
      g.after_module = [&](const GradeReport& so_far) {
        try {
          const std::string note = "Grading was still running when this was written: it holds the modules up to " +
                                   so_far.modules.back().id + ".\n\n";
          json j = to_json(so_far);
          j["unfinished"] = true;
          write_json(json_out, j);
          json gs = to_gradescope(so_far);
          gs["output"] = note + gs["output"].get<std::string>();
          write_json(gradescope_out, gs);
        } catch (const std::exception& e) {
          std::cerr << "k2c: the results so far were not written: " << e.what() << "\n";
        }
      };
      GradeReport report;
      try {
        report = grade(g, std::cerr);
      } catch (...) {
        // A run that ends on an error (the course rewritten under it, a bad submission folder)
        // leaves no results: what was written so far must not stand as a grade.
        std::error_code ignored;
        for (const std::string& path : {json_out, gradescope_out})
          if (!path.empty()) fs::remove(path, ignored);
        throw;
      }
      print_table(report, std::cout);
      write_json(json_out, to_json(report));
      write_json(gradescope_out, to_gradescope(report));
      if (!reference_out.empty()) {
        const ProcessResult nvcc = run_process({"nvcc", "--version"}, {.timeout_s = 30});
        // "Cuda compilation tools, release 13.0, V13.0.88" -> "CUDA release 13.0, V13.0.88"
        const auto at = nvcc.output.find("release ");
        const std::string toolkit =
            nvcc.exit_code == 0 && at != std::string::npos ? "CUDA " + first_line(nvcc.output.substr(at)) : "";
        write_json(reference_out, to_reference(report, toolkit));
      }
      return 0;
    }
    if (*info_cmd) {
      std::cout << "course root:   " << root << "\n";
      std::cout << "nvcc:          " << (on_path("nvcc") ? "found" : "not found: GPU modules cannot be built") << "\n";
      std::cout << "mpirun:        " << (on_path("mpirun") ? "found" : "not found") << "\n";
      std::cout << "sanitizer:     " << (on_path("compute-sanitizer") ? "compute-sanitizer found" : "compute-sanitizer not found (--sanitize unavailable)") << "\n";
      std::string err;
      const json probe = run_probe(false, &err);
      if (probe.is_null())
        std::cout << "device:        unknown: " << err << "\n";
      else if (!probe["device"].value("present", false))
        std::cout << "device:        none (" << probe["device"].value("reason", "") << ")\n";
      else
        std::cout << "device:        " << probe["device"]["name"].get<std::string>() << ", sm_"
                  << probe["device"]["cc"].get<std::string>() << ", " << probe["device"]["sms"] << " SMs\n";
      const bool gpu = !probe.is_null() && probe["device"].value("present", false);
      const int gpus = gpu ? probe["device"].value("count", 1) : 0;
      // Without a CUDA toolkit the GPU tests are not even built; with one, but no answer from the
      // probe, whether this machine can run them is not known.
      const bool unknown = probe.is_null() && kBuiltWithCuda;
      const std::string why_no_gpu =
          probe.is_null() ? err : gpu ? "" : probe["device"].value("reason", std::string("no CUDA device"));
      const k2c::Rubric rubric = k2c::load_rubric((fs::path(root) / "autograder" / "rubric.json").string());
      std::cout << "modules:\n";
      for (const auto& m : rubric.modules) {
        std::string can;
        if (m.kind == "cpu") {
          can = "fully gradable here";
        } else if (m.kind == "gpu") {
          can = gpu       ? "fully gradable here"
                : unknown ? "unknown: " + err
                          : "GPU tests will be skipped here (" + why_no_gpu + ")";
        } else {  // mpi: runs on CPU ranks, and NCCL runs that need a GPU per rank
          int nccl = 0;
          for (const auto& r : m.runs)
            if (r.backend == "nccl") nccl = std::max(nccl, r.ranks);
          if (!on_path("mpirun"))
            can = "needs mpirun (Open MPI): make deps";
          else if (nccl == 0 || gpus >= nccl)
            can = "fully gradable here";
          else if (unknown)
            can = "MPI runs gradable here; the NCCL run (" + std::to_string(nccl) + " GPUs): unknown: " + err;
          else
            can = "MPI runs gradable here; the NCCL run needs " + std::to_string(nccl) + " GPUs (" +
                  (gpus ? "this machine has " + std::to_string(gpus) : why_no_gpu) + "): skipped";
        }
        std::cout << "  " << m.id << "  " << m.points() << " points, " << m.kind << ": " << can << "\n";
      }
      return 0;
    }
    if (*ceilings_cmd) {
      std::string err;
      const json probe = run_probe(true, &err);
      if (probe.is_null()) throw std::runtime_error(err);
      std::cout << probe.dump(2) << "\n";
      write_json(ceilings_json, probe);
      return 0;
    }
    if (*bench_cmd) {
      const fs::path bin = fs::path(g.build_dir) / "bin";
      const fs::path out = bench_dir.empty() ? fs::path(g.build_dir) / "bench" : fs::path(bench_dir);
      std::vector<fs::path> programs;
      if (fs::is_directory(bin))
        for (const auto& e : fs::directory_iterator(bin))
          if (e.path().filename().string().rfind("k2c_bench_", 0) == 0) programs.push_back(e.path());
      std::sort(programs.begin(), programs.end());
      if (programs.empty())
        throw std::runtime_error("no benchmark programs in " + bin.string() + " (build first; Google Benchmark and CUDA are needed)");
      fs::create_directories(out);
      for (const fs::path& p : programs) {
        const std::string name = p.filename().string().substr(10);
        std::cerr << "bench " << name << " ...\n";
        const ProcessResult r = run_process(
            {p.string(), "--benchmark_filter=" + bench_filter, "--benchmark_out_format=json",
             "--benchmark_out=" + (out / (name + ".json")).string()},
            {.timeout_s = 1800});
        std::cout << r.output;
        if (r.exit_code != 0) std::cerr << "bench " << name << ": " << describe_exit(r, 1800) << "\n";
      }
      std::cerr << "results: " << out.string() << "\n";
      return 0;
    }
    if (*coll_cmd) {
      const fs::path program = fs::path(g.build_dir) / "bin" / "k2c_collectives";
      const fs::path beside = self_dir() / "k2c_collectives";
      const fs::path bin = fs::exists(program) ? program : beside;
      if (!fs::exists(bin)) throw std::runtime_error("k2c_collectives is not built (it needs MPI)");
      std::vector<std::string> args = {bin.string()};
      for (const std::string& e : coll_cmd->remaining()) args.push_back(e);
      exec_launch(mpirun_command(coll_launch, args));
    }
    if (*run_cmd) {
      if (launch.dist_timeout_s < 0) throw UsageError("--timeout: seconds, 0 or more (0: the runtime's default)");
      exec_launch(mpirun_command(launch, run_cmd->remaining()));
    }
    if (*train_cmd) {
      // k2c_train is built beside k2c (common/model/apps/train.cpp); its own options follow.
      const fs::path bin = self_dir() / "k2c_train";
      if (!fs::exists(bin)) throw std::runtime_error("k2c_train is not built beside " + self_dir().string());
      std::vector<std::string> args = {bin.string()};
      for (const std::string& e : train_cmd->remaining()) args.push_back(e);
      std::vector<char*> argv_c;
      for (std::string& a : args) argv_c.push_back(a.data());
      argv_c.push_back(nullptr);
      execv(argv_c[0], argv_c.data());
      throw std::runtime_error("cannot run " + bin.string() + ": " + std::strerror(errno));
    }
    if (*handout_cmd) {
      copy_handout(root, handout_dir);
      std::cout << "handout written to " << handout_dir << " (without solutions/)\n";
      return 0;
    }
  } catch (const k2c::RubricError& e) {
    std::cerr << "k2c: " << e.what() << "\n";
    return 2;
  } catch (const UsageError& e) {
    std::cerr << "k2c: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "k2c: " << e.what() << "\n";
    const std::string what = e.what();
    return what.rfind("unknown module", 0) == 0 || what.rfind("submission", 0) == 0 || what.rfind("run:", 0) == 0 ? 2 : 1;
  }
  return 0;
}
