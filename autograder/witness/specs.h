// specs.h — what each witness of k2c_witness launches and how its output is judged.
//
// A witness names one timed kernel of a module's performance test (the rubric's "witness"); the
// test program registers what a launch runs under the same name (K2C_WITNESS in its tests). The
// spec fixes the shape and the buffers of one launch, fills the inputs from a seed, says where to
// read the output, and checks what was read against the CPU reference, all without the test
// program's help.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace k2c::witness_specs {

struct Buffer {
  std::size_t bytes = 0;
  bool output = false;  // poisoned before each window; inputs (and buffers updated in place) are filled
};

// Bytes [offset, offset + bytes) of one buffer of a launch.
struct Range {
  std::uint32_t buffer = 0;
  std::uint64_t offset = 0, bytes = 0;
};

struct Spec {
  std::string name;
  std::vector<std::int64_t> shape;
  std::vector<Buffer> buffers;
  double work = 0;          // bytes moved or FLOPs per launch
  std::string unit;         // the rubric's unit for work per second: "GB/s" or "TFLOP/s"
  double unit_scale = 1e9;  // work per second / unit_scale = the figure
  int max_sets = 32;        // fewer for slow kernels: a window of the slowest still passes quickly
  // Fills a launch's inputs (device pointers, in the order of `buffers`) from `seed`.
  std::function<void(const std::vector<char*>& buffers, std::uint64_t seed)> fill;
  // Where to read one launch's output: always the same number of ranges.
  std::function<std::vector<Range>(std::mt19937_64& rng)> sample;
  // "" or the first problem with what was read at `ranges` (bytes[i] holds ranges[i]).
  std::function<std::string(std::uint64_t seed, const std::vector<Range>& ranges,
                            const std::vector<const char*>& bytes)>
      check;
};

// nullptr for a name no spec has.
const Spec* find(const std::string& name);

}  // namespace k2c::witness_specs
