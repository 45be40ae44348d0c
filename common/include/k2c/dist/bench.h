// k2c/dist/bench.h — the command line and the JSON file of Part II's MPI programs (the sweeps in
// autograder/NN_name/name_bench.cpp), written once for all of them.
//
// Flags come in "-x value" pairs, from nccl-tests' vocabulary where one fits (-b -e -f -n -w -o),
// or as switches without a value (--ledger): parse_flags hands each value to its flag's setter,
// prints the program's usage line for -h or --help, and refuses an unknown flag, or one missing
// its value, with that line. Sizes take K, M and G for powers of 1024, as
// nccl-tests' do; lists are comma-separated. A sweep's JSON file is one line holding one object:
// the run's fields (backend, ranks, the sizes it swept), then "rows", one object per measured
// point. Fields keep the order they were added in, and numbers print as a C++ stream prints
// them (six significant digits), so tools/figures.py reads every program's file alike.
//
// Header-only and host-only: the programs link k2c_dist, and nothing here needs it.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "k2c/dist/communicator.h"

namespace k2c::dist {

// "64", "4K", "1M", "1.5G": a count of bytes, K, M and G meaning powers of 1024 (a fraction of a
// byte is dropped).
inline std::size_t parse_size(const std::string& s) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  switch (end && *end ? *end : ' ') {
    case 'K': case 'k': v *= 1024; break;
    case 'M': case 'm': v *= 1024 * 1024; break;
    case 'G': case 'g': v *= 1024.0 * 1024 * 1024; break;
    default: break;
  }
  return static_cast<std::size_t>(v);
}

// "1K,4K,1M": sizes as parse_size reads them; empty items are skipped.
inline std::vector<std::size_t> parse_sizes(const std::string& list) {
  std::vector<std::size_t> out;
  std::stringstream in(list);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(parse_size(item));
  return out;
}

// "1024,2048,4096": whole numbers (std::stoll, which throws on an item that is not one).
inline std::vector<std::int64_t> parse_counts(const std::string& list) {
  std::vector<std::int64_t> out;
  std::stringstream in(list);
  for (std::string item; std::getline(in, item, ',');) out.push_back(std::stoll(item));
  return out;
}

// What each flag does with its value, and each switch (a flag without one) when it is given.
using FlagSetters = std::map<std::string, std::function<void(const std::string&)>>;
using FlagSwitches = std::map<std::string, std::function<void()>>;

// Reads argv[1..]: a flag of `flags` takes the next argument as its value, a switch none. -h or
// --help prints "usage: <program> <usage>" to stdout and exits 0 (before any rank starts work);
// an unknown flag, a flag without its value, or a value its setter throws on (std::stoi's "not a
// number") prints the same line to stderr and returns false (the program then exits 2, the code
// of a bad command line).
inline bool parse_flags(int argc, char** argv, const FlagSetters& flags, const std::string& usage,
                        const FlagSwitches& switches = {}) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::printf("usage: %s %s\n", argv[0], usage.c_str());
      std::exit(0);
    }
    if (const auto s = switches.find(a); s != switches.end()) {
      s->second();
      continue;
    }
    const auto f = flags.find(a);
    if (f == flags.end() || i + 1 >= argc) {
      std::fprintf(stderr, "usage: %s %s\n", argv[0], usage.c_str());
      return false;
    }
    try {
      f->second(argv[++i]);
    } catch (const std::exception&) {
      std::fprintf(stderr, "%s: %s '%s' is not a value it takes\nusage: %s %s\n", argv[0], a.c_str(), argv[i], argv[0],
                   usage.c_str());
      return false;
    }
  }
  return true;
}

// The fields of one JSON object, in the order added. Keys and string values are written as
// they are: the programs use names and numbers only, which need no escaping.
class JsonFields {
 public:
  template <class T>
  JsonFields& add(const std::string& key, const T& value) {
    next(key) << value;
    return *this;
  }
  JsonFields& add(const std::string& key, const std::string& value) {
    next(key) << '"' << value << '"';
    return *this;
  }
  JsonFields& add(const std::string& key, const char* value) { return add(key, std::string(value)); }
  std::string fields() const { return out_.str(); }  // without the braces

 private:
  std::ostringstream& next(const std::string& key) {
    out_ << (out_.tellp() > 0 ? ", " : "") << '"' << key << "\": ";
    return out_;
  }
  std::ostringstream out_;
};

// The fields every sweep starts with: the backend, the model library's backend that computed
// (`ops`, its Ops::name()) and the number of ranks.
inline JsonFields run_fields(const Communicator& w, const std::string& ops) {
  JsonFields f;
  f.add("backend", to_string(w.backend())).add("ops", ops).add("ranks", w.size());
  return f;
}

// Writes {<run's fields>, "rows": [{<row>}, ...]} and a newline to `path`.
inline void write_sweep_json(const std::string& path, const JsonFields& run, const std::vector<JsonFields>& rows) {
  std::ofstream f(path);
  f << "{" << run.fields() << ", \"rows\": [";
  for (std::size_t i = 0; i < rows.size(); ++i) f << (i ? ", {" : "{") << rows[i].fields() << "}";
  f << "]}\n";
}

}  // namespace k2c::dist
