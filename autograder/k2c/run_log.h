// run_log.h — what a test program's run left behind, read for the grader's verdicts: its
// output (compiler errors, undefined symbols, a rank's failure, a sticky CUDA error) and the
// properties of its GoogleTest report.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace k2c::grader {

std::string read_file(const std::filesystem::path& p);
// At most n lines of text, cut at max_chars.
std::string first_lines(const std::string& text, int n, std::size_t max_chars = 600);
// The first compiler errors of a failed build, or its last lines if none look like errors.
std::string compiler_errors(const std::string& log);
// The symbols a failed link names as undefined, in order, each once.
std::vector<std::string> undefined_symbols(const std::string& log);
// The first failure line a rank printed ("rank r: ..."), or "".
std::string rank_failure(const std::string& log);
// The message a test program prints before ending itself on a sticky CUDA error, or "".
std::string fatal_line(const std::string& log);
// A test's number property (a JSON number or a numeric string); *ok = false when absent or not
// a number.
double number_property(const nlohmann::json& t, const char* key, bool* ok);
// A string property ("" when absent), with the characters outside ASCII that GoogleTest's JSON
// report escaped byte by byte put back together.
std::string string_property(const nlohmann::json& j, const char* key);
// A property recorded outside any test (the device, the seed): at the top level of GoogleTest's
// JSON report or on its test suites, depending on the GoogleTest version.
std::string global_property(const nlohmann::json& report, const char* key);

// How deep a JSON text's arrays and objects nest (brackets inside strings not counted).
int json_nesting(const std::string& text);
// The GoogleTest report (or a checker's verdict) a run left at `path`, which the code under test
// could have replaced with a link (to a file only the grader may read, a FIFO that never ends,
// /dev/zero) or made to exhaust the grader: opened without following links and without blocking,
// read only if it is a plain file, and "" (no report) past 4 MiB or 32 levels of nesting (64 MiB
// of '[' once took the grader to 5 GB of memory). Honest reports are tens of kilobytes.
std::string read_report(const std::filesystem::path& path);

}  // namespace k2c::grader
