// run_log.cpp — see run_log.h.
#include "run_log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <set>
#include <sstream>

#include "process.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace k2c::grader {
namespace {

// "rank 3: ..." — how the distributed runtime names a rank that threw before it aborts the job,
// and how ranks other than 0 print their failed assertions.
bool is_rank_line(const std::string& line) {
  if (line.rfind("rank ", 0) != 0) return false;
  std::size_t i = 5;
  if (i < line.size() && line[i] == '-') ++i;
  const std::size_t digits = i;
  while (i < line.size() && std::isdigit(static_cast<unsigned char>(line[i]))) ++i;
  return i > digits && line.compare(i, 2, ": ") == 0;
}

// GoogleTest's JSON report escapes each byte of a character outside ASCII on its own ("³", the
// bytes C2 B3, becomes "\u00c2\u00b3": its escaping compares a signed char with ' '), so the
// parsed string holds one code point per byte. Where every code point is below 256 and their
// bytes are well-formed UTF-8, those bytes are what the test wrote.
std::string undo_byte_escapes(const std::string& s) {
  std::string bytes;
  bytes.reserve(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      bytes += s[i];
    } else if ((c == 0xC2 || c == 0xC3) && i + 1 < s.size()) {  // U+0080 to U+00FF
      bytes += static_cast<char>((c & 0x03) << 6 | (static_cast<unsigned char>(s[++i]) & 0x3F));
    } else {
      return s;  // a code point past 255: not one byte escaped
    }
  }
  return valid_utf8(bytes) == bytes ? bytes : s;
}

}  // namespace

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string first_lines(const std::string& text, int n, std::size_t max_chars) {
  std::istringstream in(text);
  std::string line, out;
  for (int i = 0; i < n && std::getline(in, line); ++i) out += (i ? "\n" : "") + line;
  if (out.size() > max_chars) out = utf8_head(out, max_chars) + " ...";
  return out;
}

// The first compiler errors of a failed build, or its last lines if none look like errors.
std::string compiler_errors(const std::string& log) {
  std::istringstream in(log);
  std::string line, out;
  int kept = 0;
  while (std::getline(in, line) && kept < 12)
    if (line.find("error") != std::string::npos || line.find("Error") != std::string::npos) {
      out += (kept++ ? "\n" : "") + line;
    }
  if (!out.empty()) return out;
  std::vector<std::string> lines;
  std::istringstream all(log);
  while (std::getline(all, line)) lines.push_back(line);
  for (std::size_t i = lines.size() > 15 ? lines.size() - 15 : 0; i < lines.size(); ++i)
    out += lines[i] + "\n";
  return out;
}

// Symbols a failed link could not resolve, in order of first mention: GNU ld's "undefined
// reference to `X'", gold's "undefined reference to 'X'", lld's "undefined symbol: X".
std::vector<std::string> undefined_symbols(const std::string& log) {
  std::vector<std::string> out;
  std::istringstream in(log);
  for (std::string line; std::getline(in, line);) {
    std::string name;
    if (const auto at = line.find("undefined reference to "); at != std::string::npos) {
      std::size_t start = at + 23;
      if (start < line.size() && (line[start] == '`' || line[start] == '\'')) ++start;
      const auto end = line.find('\'', start);
      name = line.substr(start, end == std::string::npos ? std::string::npos : end - start);
    } else if (const auto at2 = line.find("undefined symbol: "); at2 != std::string::npos) {
      name = line.substr(at2 + 18);
      while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
    }
    if (!name.empty() && std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  }
  return out;
}


// The first failure a rank reported in a distributed run's output, on one line with up to three
// lines that continue it; "" when none. A failed assertion continues on indented lines, and
// FAIL() / ADD_FAILURE() put their text on the line after "Failed". Echoes of "failed on another
// rank" are passed over: they only point at the rank that failed.
std::string rank_failure(const std::string& log) {
  std::vector<std::string> lines;
  std::istringstream in(log);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  auto blank = [](const std::string& l) { return l.find_first_not_of(" \t\r") == std::string::npos; };
  for (std::size_t i = 0; i < lines.size(); ++i) {
    if (!is_rank_line(lines[i])) continue;
    std::string block = lines[i];
    std::size_t j = i + 1;
    int added = 0;
    if (block.ends_with(": Failed") && j < lines.size() && !blank(lines[j]) && !is_rank_line(lines[j]))
      block += " / " + lines[j++], ++added;
    for (; j < lines.size() && added < 3 && !blank(lines[j]) && std::isspace(static_cast<unsigned char>(lines[j][0])); ++j, ++added)
      block += " / " + lines[j].substr(lines[j].find_first_not_of(" \t"));
    if (block.find("failed on another rank") != std::string::npos) continue;
    return block.size() > 400 ? utf8_head(block, 400) + " ..." : block;
  }
  return "";
}

// A line the test program prints before ending itself on a sticky CUDA error.
std::string fatal_line(const std::string& log) {
  const auto at = log.find("K2C_FATAL:");
  if (at == std::string::npos) return "";
  return log.substr(at + 10, log.find('\n', at) - at - 10);
}

double number_property(const json& t, const char* key, bool* ok) {
  auto it = t.find(key);
  if (it == t.end()) {
    *ok = false;
    return 0;
  }
  try {
    if (it->is_number()) return it->get<double>();
    if (it->is_string()) return std::stod(it->get<std::string>());
  } catch (...) {
  }
  *ok = false;
  return 0;
}

std::string string_property(const json& j, const char* key) {
  // The report is the code under test's to write: no string from it goes on at any length into
  // messages, tables and results.json (an honest failure message is a few lines).
  constexpr std::size_t kLongest = 16384;
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? utf8_head(undo_byte_escapes(it->get<std::string>()), kLongest) : "";
}

// Properties recorded outside any test (the device, the seed) appear at the top level of
// GoogleTest's JSON report or on the test suites, depending on the GoogleTest version.
std::string global_property(const json& report, const char* key) {
  std::string v = string_property(report, key);
  if (!v.empty() || !report.contains("testsuites")) return v;
  for (const json& s : report["testsuites"])
    if (!(v = string_property(s, key)).empty()) return v;
  return v;
}

int json_nesting(const std::string& text) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

std::string read_report(const std::filesystem::path& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return "";
  struct stat st {};
  std::string text;
  constexpr std::size_t kMax = std::size_t{4} << 20;
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
    char buf[65536];
    ssize_t n = 0;
    while (text.size() <= kMax && (n = read(fd, buf, sizeof buf)) > 0) text.append(buf, static_cast<std::size_t>(n));
  }
  close(fd);
  if (text.size() > kMax || json_nesting(text) > 32) return "";
  return text;
}

}  // namespace k2c::grader
