// verdict_file.h — how both checkers (k2c_witness, k2c_rank_witness) write their verdict for the
// grader.
#pragma once

#include <cstdio>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

namespace k2c::witness_io {

// Written whole or not at all (a .part file renamed), so that the grader never reads half a
// verdict and one already there is never left empty. The test program's output it quotes may be
// any bytes: replaced where they are not UTF-8, not thrown on.
inline void write_verdict(const std::string& path, const nlohmann::json& v) {
  const std::string tmp = path + ".part";
  std::ofstream(tmp) << v.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  std::rename(tmp.c_str(), path.c_str());
}

}  // namespace k2c::witness_io
