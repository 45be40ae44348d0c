// rubric.cpp — see k2c/core/rubric.h. Validation is strict: a typo in a rubric must stop grading
// with a message naming the field, not silently award or withhold points.
#include "k2c/core/rubric.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

namespace k2c {
namespace {

using nlohmann::json;

class Reader {
 public:
  explicit Reader(std::string origin) : origin_(std::move(origin)) {}

  [[noreturn]] void error(const std::string& path, const std::string& what) const {
    throw RubricError(origin_ + ": " + path + ": " + what);
  }
  const json& field(const json& obj, const std::string& path, const char* key) const {
    if (!obj.is_object()) error(path, "expected an object");
    auto it = obj.find(key);
    if (it == obj.end()) error(path + "." + key, "missing");
    return *it;
  }
  std::string string(const json& obj, const std::string& path, const char* key) const {
    const json& v = field(obj, path, key);
    if (!v.is_string() || v.get<std::string>().empty())
      error(path + "." + key, "expected a non-empty string");
    return v.get<std::string>();
  }
  double number(const json& obj, const std::string& path, const char* key) const {
    const json& v = field(obj, path, key);
    if (!v.is_number()) error(path + "." + key, "expected a number");
    return v.get<double>();
  }
  // An optional true/false field: `fallback` when absent.
  bool flag(const json& obj, const std::string& path, const char* key, bool fallback = false) const {
    auto it = obj.find(key);
    if (it == obj.end()) return fallback;
    if (!it->is_boolean()) error(path + "." + key, "expected true or false");
    return it->get<bool>();
  }
  void only_keys(const json& obj, const std::string& path,
                 std::initializer_list<const char*> keys) const {
    for (auto it = obj.begin(); it != obj.end(); ++it) {
      bool known = false;
      for (const char* k : keys) known = known || it.key() == k;
      if (!known) error(path + "." + it.key(), "unknown field");
    }
  }

 private:
  std::string origin_;
};

PerfSpec read_perf(const Reader& rd, const json& j, const std::string& path) {
  rd.only_keys(j, path, {"ceiling", "unit", "threshold", "goal", "max_ratio", "witness"});
  PerfSpec p;
  p.ceiling = rd.string(j, path, "ceiling");
  p.unit = rd.string(j, path, "unit");
  p.max_ratio = rd.number(j, path, "max_ratio");
  p.threshold = rd.number(j, path, "threshold");
  p.goal = rd.number(j, path, "goal");
  if (j.contains("witness")) p.witness = rd.string(j, path, "witness");
  if (!(p.max_ratio > 0)) rd.error(path + ".max_ratio", "expected a number > 0");
  if (!(p.threshold > 0 && p.threshold <= p.max_ratio))
    rd.error(path + ".threshold", "expected a number in (0, max_ratio]");
  if (!(p.goal >= p.threshold && p.goal <= p.max_ratio))
    rd.error(path + ".goal", "expected a number in [threshold, max_ratio]");
  return p;
}

TestSpec read_test(const Reader& rd, const json& j, const std::string& path) {
  rd.only_keys(j, path, {"name", "points", "bonus", "device", "nccl", "perf", "witness", "rank_witness", "rank_witness_ranks"});
  TestSpec t;
  t.name = rd.string(j, path, "name");
  static const std::regex kName("[A-Za-z][A-Za-z0-9_]*\\.[A-Za-z][A-Za-z0-9_/]*");
  if (!std::regex_match(t.name, kName)) rd.error(path + ".name", "expected \"Suite.Name\"");
  t.points = rd.number(j, path, "points");
  if (!(t.points >= 0)) rd.error(path + ".points", "expected a number >= 0");
  t.bonus = rd.flag(j, path, "bonus");
  t.device = rd.flag(j, path, "device");
  t.nccl = rd.flag(j, path, "nccl");
  if (t.nccl && !t.device) rd.error(path + ".nccl", "a test that runs on NCCL only needs a device: \"device\": true");
  if (j.contains("perf")) t.perf = read_perf(rd, j["perf"], path + ".perf");
  if (j.contains("witness")) {
    t.witness = rd.string(j, path, "witness");
    if (t.perf) rd.error(path + ".witness", "a performance test names its witness in perf.witness");
  }
  if (j.contains("rank_witness")) {
    t.rank_witness = rd.string(j, path, "rank_witness");
    if (t.perf || !t.witness.empty())
      rd.error(path + ".rank_witness", "only a correctness test without a \"witness\" has a rank witness");
  }
  if (j.contains("rank_witness_ranks")) {
    const double ranks = rd.number(j, path, "rank_witness_ranks");
    if (t.rank_witness.empty()) rd.error(path + ".rank_witness_ranks", "only a test with a \"rank_witness\" has its ranks");
    if (!(ranks >= 1 && ranks <= 1024 && ranks == static_cast<int>(ranks)))
      rd.error(path + ".rank_witness_ranks", "expected an integer in 1..1024");
    t.rank_witness_ranks = static_cast<int>(ranks);
  }
  return t;
}

ModuleSpec read_module(const Reader& rd, const json& j, const std::string& path) {
  rd.only_keys(j, path, {"id", "title", "kind", "build", "timeout_s", "runs", "files", "tests"});
  ModuleSpec m;
  m.id = rd.string(j, path, "id");
  static const std::regex kId("[0-9]{2}_[a-z0-9_]+");
  if (!std::regex_match(m.id, kId)) rd.error(path + ".id", "expected \"NN_snake_name\"");
  m.title = rd.string(j, path, "title");
  m.kind = rd.string(j, path, "kind");
  if (m.kind != "gpu" && m.kind != "cpu" && m.kind != "mpi")
    rd.error(path + ".kind", "expected \"gpu\", \"cpu\" or \"mpi\"");
  if (m.kind == "mpi") {
    const json& runs = rd.field(j, path, "runs");
    if (!runs.is_array() || runs.empty()) rd.error(path + ".runs", "expected a non-empty array");
    for (std::size_t i = 0; i < runs.size(); ++i) {
      const std::string rp = path + ".runs[" + std::to_string(i) + "]";
      rd.only_keys(runs[i], rp, {"backend", "ranks"});
      RunSpec r;
      r.backend = rd.string(runs[i], rp, "backend");
      if (r.backend != "mpi" && r.backend != "nccl") rd.error(rp + ".backend", "expected \"mpi\" or \"nccl\"");
      const double ranks = rd.number(runs[i], rp, "ranks");
      if (!(ranks >= 1 && ranks <= 1024 && ranks == static_cast<int>(ranks)))
        rd.error(rp + ".ranks", "expected an integer in 1..1024");
      r.ranks = static_cast<int>(ranks);
      m.runs.push_back(r);
    }
  } else if (j.contains("runs")) {
    rd.error(path + ".runs", "only modules of kind \"mpi\" have runs");
  }
  // How CMake builds it (autograder/CMakeLists.txt reads the same fields): linked with the model
  // library, with the implementations of earlier modules, and for sm_90a.
  if (j.contains("build")) {
    const json& b = j["build"];
    const std::string bp = path + ".build";
    rd.only_keys(b, bp, {"model", "uses", "sm90a"});
    m.model = rd.flag(b, bp, "model", m.model);
    m.sm90a = rd.flag(b, bp, "sm90a", m.sm90a);
    if (b.contains("uses")) {
      if (!b["uses"].is_array()) rd.error(bp + ".uses", "expected an array of module ids");
      for (std::size_t i = 0; i < b["uses"].size(); ++i) {
        const std::string up = bp + ".uses[" + std::to_string(i) + "]";
        if (!b["uses"][i].is_string()) rd.error(up, "expected a module id");
        m.uses.push_back(b["uses"][i].get<std::string>());
      }
    }
  }
  const double timeout = rd.number(j, path, "timeout_s");
  if (!(timeout >= 1 && timeout <= 86400)) rd.error(path + ".timeout_s", "expected 1..86400");
  m.timeout_s = static_cast<int>(timeout);

  const json& files = rd.field(j, path, "files");
  if (!files.is_array()) rd.error(path + ".files", "expected an array of paths");
  for (std::size_t i = 0; i < files.size(); ++i) {
    const std::string fp = path + ".files[" + std::to_string(i) + "]";
    if (!files[i].is_string()) rd.error(fp, "expected a string");
    const std::string f = files[i].get<std::string>();
    if (f.empty() || f.front() == '/' || f.find("..") != std::string::npos)
      rd.error(fp, "expected a relative path inside the repository");
    m.files.push_back(f);
  }

  const json& tests = rd.field(j, path, "tests");
  if (!tests.is_array() || tests.empty()) rd.error(path + ".tests", "expected a non-empty array");
  std::set<std::string> seen;
  for (std::size_t i = 0; i < tests.size(); ++i) {
    const std::string tp = path + ".tests[" + std::to_string(i) + "]";
    m.tests.push_back(read_test(rd, tests[i], tp));
    if (!seen.insert(m.tests.back().name).second) rd.error(tp + ".name", "duplicate test");
    if (!m.tests.back().rank_witness.empty() && m.kind != "mpi")
      rd.error(tp + ".rank_witness", "only a module of kind \"mpi\" runs on ranks");
    const int ranks = m.tests.back().rank_witness_ranks;
    if (ranks > 0 && std::none_of(m.runs.begin(), m.runs.end(),
                                  [&](const RunSpec& r) { return r.backend == "mpi" && r.ranks == ranks; }))
      rd.error(tp + ".rank_witness_ranks", "the module has no MPI run on " + std::to_string(ranks) + " ranks");
  }
  return m;
}

}  // namespace

double ModuleSpec::points() const {
  double sum = 0;
  for (const TestSpec& t : tests) sum += t.bonus ? 0 : t.points;
  return sum;
}

double ModuleSpec::bonus_points() const {
  double sum = 0;
  for (const TestSpec& t : tests) sum += t.bonus ? t.points : 0;
  return sum;
}

const TestSpec* ModuleSpec::find_test(std::string_view name) const {
  for (const TestSpec& t : tests)
    if (t.name == name) return &t;
  return nullptr;
}

const ModuleSpec* Rubric::find(std::string_view key) const {
  for (const ModuleSpec& m : modules) {
    if (m.id == key || m.number() == key) return &m;
    if (key.size() == 1 && m.number() == "0" + std::string(key)) return &m;
  }
  return nullptr;
}

Rubric parse_rubric(const std::string& text, const std::string& origin) {
  const Reader rd(origin);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    throw RubricError(origin + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) rd.error("(top level)", "expected an object");
  rd.only_keys(j, "(top level)", {"$comment", "version", "max_file_bytes", "modules"});
  Rubric r;
  const double version = rd.number(j, "(top level)", "version");
  if (version != 1) rd.error("version", "unsupported version (this grader reads version 1)");
  r.version = 1;
  const double max_bytes = rd.number(j, "(top level)", "max_file_bytes");
  if (!(max_bytes >= 1 && max_bytes <= 1073741824)) rd.error("max_file_bytes", "expected 1..1073741824 (1 GiB)");
  r.max_file_bytes = static_cast<std::size_t>(max_bytes);

  const json& modules = rd.field(j, "(top level)", "modules");
  if (!modules.is_array()) rd.error("modules", "expected an array");
  std::set<std::string> ids, numbers;
  for (std::size_t i = 0; i < modules.size(); ++i) {
    const std::string mp = "modules[" + std::to_string(i) + "]";
    r.modules.push_back(read_module(rd, modules[i], mp));
    // A module builds with the implementations of modules listed before it: a typo or a later
    // module is said here, with the field, rather than by CMake in the middle of a grading.
    const std::vector<std::string>& uses = r.modules.back().uses;
    for (std::size_t u = 0; u < uses.size(); ++u)
      if (!ids.count(uses[u]))
        rd.error(mp + ".build.uses[" + std::to_string(u) + "]", "'" + uses[u] + "' is not a module listed before this one");
    if (!ids.insert(r.modules.back().id).second) rd.error(mp + ".id", "duplicate module");
    if (!numbers.insert(r.modules.back().number()).second)
      rd.error(mp + ".id", "duplicate module number");
  }
  return r;
}

Rubric load_rubric(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw RubricError(path + ": a folder, not a rubric file");
  std::ifstream in(path);
  if (!in) throw RubricError(path + ": cannot open the rubric file");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_rubric(text.str(), path);
}

}  // namespace k2c
