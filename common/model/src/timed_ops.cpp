// timed_ops.cpp — TimedOps::report (the rest is in the header).
#include "k2c/model/timed_ops.h"

#include <algorithm>
#include <cstdio>
#include <vector>

namespace k2c::model {

std::string TimedOps::report() const {
  settle();
  std::vector<std::pair<std::string, Entry>> rows(entries_.begin(), entries_.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
  double total = 0, host = 0;
  for (const auto& r : rows) total += r.second.seconds, host += r.second.host_seconds;
  std::string out;
  char line[160];
  std::snprintf(line, sizeof line, "%-26s %10s %7s %10s %7s\n", "operation", "ms", "share", "host ms", "calls");
  out += line;
  for (const auto& [name, e] : rows) {
    std::snprintf(line, sizeof line, "%-26s %10.3f %6.1f%% %10.3f %7ld\n", name.c_str(), e.seconds * 1e3,
                  total > 0 ? 100.0 * e.seconds / total : 0.0, e.host_seconds * 1e3, e.calls);
    out += line;
  }
  std::snprintf(line, sizeof line, "%-26s %10.3f %7s %10.3f\n", "total", total * 1e3, "", host * 1e3);
  return out + line;
}

}  // namespace k2c::model
