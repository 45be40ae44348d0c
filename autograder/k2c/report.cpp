// report.cpp — see grade.h: a grading's report as a table, as JSON, as Gradescope's results and
// as the reference-timings file.
#include "grade.h"

#include <ctime>
#include <iomanip>
#include <set>
#include <sstream>

#include "run_log.h"

using nlohmann::json;

namespace k2c::grader {

// ===================================================================== presentation ==========

// Verdicts that void a whole module, shown instead of per-test results.
static const std::set<std::string> kModuleLevel = {"crashed", "timed out",    "no report", "incomplete",
                                                   "invalid", "build failed", "refused",   "not graded"};

static std::string fmt(double v, int precision = 3) {
  std::ostringstream os;
  os << std::setprecision(precision) << v;
  return os.str();
}

// A performance test has a line of its own in the table's performance column, figures or not.
static bool in_perf_column(const TestOutcome& t) { return t.perf || t.name.find("Perf.") != std::string::npos; }

std::string progress_line(const std::string& tag, const ModuleOutcome& m) {
  std::string line = tag + ": " + m.status;
  if (m.status != "ok" && !m.detail.empty()) line += " — " + first_lines(m.detail, 1, 160);
  return line + " (" + fmt(m.points, 6) + "/" + fmt(m.max_points, 6) + ")";
}

void print_table(const GradeReport& r, std::ostream& out) {
  out << "\nKernels to Clusters — grade of " << r.impl << ", seed " << r.seed << ", device "
      << (r.gpu == "none" ? "none (" + (r.gpu_reason.empty() ? std::string("no CUDA device") : r.gpu_reason) + ")" : r.gpu)
      << (r.sanitize ? ", under compute-sanitizer" : "") << "\n\n";
  out << std::left << std::setw(26) << "module" << std::setw(24) << "correctness"
      << std::setw(66) << "performance: achieved / required / reference (ratio to ceiling)"
      << "points\n";
  out << std::string(126, '-') << "\n";
  for (const ModuleOutcome& m : r.modules) {
    int correct = 0, total = 0;
    std::vector<std::string> perf_lines;
    for (const TestOutcome& t : m.tests) {
      if (in_perf_column(t)) {
        std::string line = t.name + ": ";
        if (t.perf) {
          line += fmt(t.perf->ratio) + " / " + fmt(t.perf->required) + " / " +
                  (t.perf->reference_ratio ? fmt(*t.perf->reference_ratio) : "-") + " of " +
                  t.perf->ceiling_name + (t.status == "withheld" ? " (withheld)" : "");
        } else {
          line += t.status;
        }
        perf_lines.push_back(line);
      } else {
        ++total;
        correct += t.status == "passed";
      }
    }
    // Module-level verdicts replace the count; otherwise "k/n passed", with what was skipped.
    int skipped = 0;
    for (const TestOutcome& t : m.tests) skipped += t.status == "skipped" && !in_perf_column(t);
    std::string corr = std::to_string(correct) + "/" + std::to_string(total) + " passed";
    if (skipped > 0) corr += ", " + std::to_string(skipped) + " skipped";
    if (m.status == "not implemented yet" || kModuleLevel.count(m.status) || m.tests.empty()) corr = m.status;
    if (perf_lines.empty()) perf_lines.push_back("-");
    for (std::size_t i = 0; i < perf_lines.size(); ++i) {
      out << std::left << std::setw(26) << (i == 0 ? m.id : "") << std::setw(24)
          << (i == 0 ? corr : "") << std::setw(66) << perf_lines[i];
      if (i == 0) out << fmt(m.points, 4) << "/" << fmt(m.max_points, 4);
      out << "\n";
    }
    if (!m.detail.empty()) {
      std::istringstream d(m.detail);
      std::string line;
      for (int k = 0; k < 8 && std::getline(d, line); ++k) out << "    " << line << "\n";
    }
    for (const TestOutcome& t : m.tests)
      if ((t.status == "failed" || t.status == "not implemented" || t.status == "withheld" || t.status == "not run") &&
          m.status != "not implemented yet")
        out << "    " << t.name << ": " << t.status << (t.message.empty() ? "" : ": " + first_lines(t.message, 2, 300)) << "\n";
    // Each skipped test is named once: a performance test in its column, the others here; why
    // they were skipped is the detail's (skip_summary). A module skipped whole, or voided, names
    // none: its status says it all, where a list would add a line per module of a machine
    // without a GPU.
    std::string skipped_names;
    if (m.status == "ok" || m.status == "partial" || m.status == "failed")
      for (const TestOutcome& t : m.tests)
        if (t.status == "skipped" && !in_perf_column(t))
          skipped_names += (skipped_names.empty() ? "" : ", ") + t.name;
    if (!skipped_names.empty()) out << "    skipped: " << skipped_names << "\n";
  }
  out << std::string(126, '-') << "\n";
  out << std::left << std::setw(116) << "total" << fmt(r.points(), 5) << "/" << fmt(r.max_points(), 5) << "\n";
  if (!r.ceilings.empty()) {
    out << "ceilings measured in this run:";
    for (const auto& [name, v] : r.ceilings) out << "  " << name << " " << fmt(v.first, 4) << " " << v.second;
    out << "\n";
  }
  out << (r.reference_file.empty() ? "reference: no reference timings for this GPU in autograder/reference/\n"
                                   : "reference: " + r.reference_file + "\n");
}

json to_json(const GradeReport& r) {
  json j = {{"impl", r.impl}, {"seed", r.seed}, {"gpu", r.gpu}, {"gpu_reason", r.gpu_reason}, {"runner", r.runner}, {"temp_folders", r.temp_folders},
            {"processes", r.processes}, {"network", r.network},
            {"cuda_runtime", r.cuda_runtime}, {"sanitize", r.sanitize},
            {"reference_file", r.reference_file}, {"points", r.points()},
            {"max_points", r.max_points()}, {"modules", json::array()}, {"ceilings", json::object()}};
  for (const auto& [name, v] : r.ceilings) j["ceilings"][name] = {{"value", v.first}, {"unit", v.second}};
  for (const ModuleOutcome& m : r.modules) {
    json jm = {{"id", m.id}, {"title", m.title}, {"status", m.status}, {"detail", m.detail},
               {"points", m.points}, {"max_points", m.max_points}, {"seconds", m.seconds},
               {"log", m.log}, {"tests", json::array()}};
    for (const TestOutcome& t : m.tests) {
      json jt = {{"name", t.name}, {"status", t.status}, {"message", t.message},
                 {"points", t.points}, {"max_points", t.max_points}, {"bonus", t.bonus}};
      if (t.perf)
        jt["perf"] = {{"achieved", t.perf->achieved}, {"ceiling", t.perf->ceiling},
                      {"ratio", t.perf->ratio}, {"required", t.perf->required},
                      {"unit", t.perf->unit}, {"ceiling_name", t.perf->ceiling_name},
                      {"reference_ratio", t.perf->reference_ratio ? json(*t.perf->reference_ratio) : json(nullptr)},
                      {"witnessed", t.perf->witnessed ? json(*t.perf->witnessed) : json(nullptr)}};
      if (t.perf && !t.perf->not_witnessed.empty()) jt["perf"]["not_witnessed"] = t.perf->not_witnessed;
      if (t.perf && t.perf->witnessed_ceiling) jt["perf"]["witnessed_ceiling"] = *t.perf->witnessed_ceiling;
      if (!t.rechecked.empty()) jt["rechecked"] = t.rechecked;
      jm["tests"].push_back(jt);
    }
    j["modules"].push_back(jm);
  }
  return j;
}

json to_gradescope(const GradeReport& r) {
  json j = {{"score", r.points()}, {"tests", json::array()}};
  std::ostringstream table;
  print_table(r, table);
  j["output"] = table.str();
  for (const ModuleOutcome& m : r.modules) {
    // A module-level failure (crash, timeout, build error, ...) is one entry with the reason;
    // otherwise one entry per test.
    if (kModuleLevel.count(m.status) || m.tests.empty()) {
      j["tests"].push_back({{"name", m.id + ": " + m.status}, {"score", 0}, {"max_score", m.max_points},
                            {"status", "failed"}, {"output", m.detail}});
      continue;
    }
    for (const TestOutcome& t : m.tests) {
      std::string output = t.status + (t.message.empty() ? "" : ": " + t.message);
      if (t.perf)
        output += "\nachieved " + fmt(t.perf->achieved, 4) + " " + t.perf->unit + " = " +
                  fmt(t.perf->ratio) + " of " + t.perf->ceiling_name + " (required " + fmt(t.perf->required) + ")";
      // Bonus points are extra credit: a score above a max_score of 0. Without "status",
      // Gradescope judges a test by its score against max_score, and a failed bonus test (0 of 0)
      // would show as passed: say which it is.
      j["tests"].push_back({{"name", m.id + " / " + t.name + (t.bonus ? " (bonus)" : "")},
                            {"score", t.points}, {"max_score", t.bonus ? 0.0 : t.max_points},
                            {"status", t.status == "passed" ? "passed" : "failed"}, {"output", output}});
    }
  }
  return j;
}

json to_reference(const GradeReport& r, const std::string& toolkit) {
  std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  json j = {{"gpu", r.gpu}, {"date", date}, {"toolkit", toolkit}, {"cuda_runtime", r.cuda_runtime},
            {"seed", r.seed}, {"impl", r.impl}, {"ceilings", json::object()}, {"modules", json::object()}};
  for (const auto& [name, v] : r.ceilings) j["ceilings"][name] = {{"value", v.first}, {"unit", v.second}};
  for (const ModuleOutcome& m : r.modules)
    for (const TestOutcome& t : m.tests)
      if (t.perf)
        j["modules"][m.id][t.name] = {{"achieved", t.perf->achieved}, {"unit", t.perf->unit},
                                      {"ceiling", t.perf->ceiling}, {"ceiling_name", t.perf->ceiling_name},
                                      {"ratio", t.perf->ratio}, {"passed", t.status == "passed"}};
  return j;
}

}  // namespace k2c::grader
