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

using Shape = std::vector<std::int64_t>;

// One launch at one shape.
struct Spec {
  std::string name;
  Shape shape;
  std::vector<Buffer> buffers;
  double work = 0;          // bytes moved or FLOPs per launch
  std::string unit;         // the rubric's unit for work per second: "GB/s" or "TFLOP/s"
  double unit_scale = 1e9;  // work per second / unit_scale = the figure
  int max_sets = 32;        // fewer for slow kernels: a window of the slowest still passes quickly
  // Fills a launch's inputs (device pointers, in the order of `buffers`) from `seed`.
  std::function<void(const std::vector<char*>& buffers, std::uint64_t seed)> fill;
  // The output in the pieces the check takes one at a time (a row, an element, a token...):
  // `pieces` of them, piece(i) the ranges of piece i. A timed window reads `sampled` pieces of
  // each launch at random; a correctness run reads them all.
  std::int64_t pieces = 0;
  std::function<std::vector<Range>(std::int64_t i)> piece;
  int sampled = 1;
  // "" or the first problem with what was read at `ranges` (bytes[i] holds ranges[i]): a list of
  // whole pieces, in any order.
  std::function<std::string(std::uint64_t seed, const std::vector<Range>& ranges,
                            const std::vector<const char*>& bytes)>
      check;
};

// A kernel the checker knows: the shape its performance test times, and the shapes of its
// correctness runs, drawn within the contract the module's tests check (tails, non-powers of two,
// tiny sizes), so that an honest kernel that passes the tests passes them too.
struct Witness {
  std::string name;
  Shape timed;
  std::function<Spec(const Shape&)> make;
  std::function<Shape(std::mt19937_64&)> draw;
};

// Every witness, and the one of a name (nullptr for a name no witness has).
const std::vector<Witness>& all();
const Witness* find(const std::string& name);

// Module 09's backward check apart from the checker's run, which calls it with what its own forward
// pass kept for a launch's seed: lse, D = Σ dO ∘ O and e = Σ |dO ∘ O| of every query row (heads
// first, as the launch's lse). Whole pieces of dq (buffer 6) and of dk with dv (7 and 8), bytes[i]
// holding ranges[i]; "" or the first problem. attention_input(seed, b, i) is element i of input
// buffer b of that launch (q 0, k 1, v 2, dout 4), as its fill draws it.
struct AttentionRows {
  std::vector<float> lse;
  std::vector<double> D, e;
};
std::string check_attention_backward(const Shape& shape, std::uint64_t seed, const AttentionRows& rows,
                                     const std::vector<Range>& ranges, const std::vector<const char*>& bytes);
float attention_input(std::uint64_t seed, int buffer, std::int64_t i);

}  // namespace k2c::witness_specs
