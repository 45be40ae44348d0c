// ring_pipeline.cpp — the reference ring's pipeline, forced (run by CTest under mpirun -np 2,
// 3 and 4 on the MPI backend). The reference solution of module 11 is compiled into this
// program and called with chunks of at least 4 bytes (RingOptions), so every block of more than one
// element is cut into chunks (up to its maximum of 8, empty chunks included) at sizes where the
// module's own tests run it in one piece. Checked for each count, type and operation:
//   all-reduce, out of place and in place, and reduce-scatter, bit for bit against the ring's
//   own order of reduction, x_b (op) (x_{b-1} (op) ( ... (x_{b+2} (op) x_{b+1}))) for block b:
//   chunking may change when an element is reduced, never in which order;
//   64 guard bytes after every output come back untouched.
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "collectives.h"
#include "k2c/dist/runtime.h"

namespace kd = k2c::dist;
namespace col = k2c::collectives;

namespace {

// Chunks of one element and up: the pipeline at sizes a test can check quickly.
constexpr col::RingOptions kTinyChunks{.min_chunk_bytes = 4, .max_chunks = 8};

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("pipeline check failed: " + what);
}

// Rank r's input: small integers (exact in every type) for i32, fractions in [-1, 1] for floats.
template <class T>
std::vector<T> input(int r, std::size_t count) {
  std::vector<T> v(count);
  for (std::size_t i = 0; i < count; ++i) {
    const int k = static_cast<int>((r * 7919u + i * 104729u) % 2001u) - 1000;
    v[i] = std::is_integral_v<T> ? static_cast<T>(k) : static_cast<T>(k) / static_cast<T>(997);
  }
  return v;
}

template <class T>
T apply(kd::ReduceOp op, T a, T b) {
  return op == kd::ReduceOp::sum ? static_cast<T>(a + b) : (a < b ? b : a);
}

// The ring's result, in the ring's order: block b starts on rank b+1 and every rank on the way
// computes own (op) received, rank b last.
template <class T>
std::vector<T> ring_order(std::size_t count, int n, kd::ReduceOp op) {
  std::vector<std::vector<T>> x;
  for (int r = 0; r < n; ++r) x.push_back(input<T>(r, count));
  std::vector<T> want(count);
  for (int b = 0; b < n; ++b) {
    const kd::Block blk = kd::block_of(count, n, b);
    for (std::size_t i = blk.offset; i < blk.offset + blk.size; ++i) {
      T acc = x[(b + 1) % n][i];
      for (int h = 2; h <= n; ++h) acc = apply(op, x[(b + h) % n][i], acc);
      want[i] = acc;
    }
  }
  return want;
}

enum class Which { all_reduce, all_reduce_in_place, reduce_scatter };

template <class T>
void check(kd::Communicator& w, Which which, kd::DType t, kd::ReduceOp op, std::size_t count) {
  kd::PointToPointView p2p(w);
  const int n = w.size(), r = w.rank();
  const kd::Block mine = kd::block_of(count, n, r);
  const std::vector<T> in = input<T>(r, count);
  const std::size_t bytes = count * sizeof(T), guard = 64;
  kd::Buffer data(w, bytes + guard), out(w, bytes + guard);
  const std::vector<unsigned char> poison(bytes + guard, 0xFF);
  w.to_backend(out.get(), poison.data(), poison.size());
  w.to_backend(data.get(), poison.data(), poison.size());
  w.to_backend(data.get(), in.data(), bytes);
  if (which == Which::all_reduce) col::ring_all_reduce(p2p, data.get(), out.get(), count, t, op, kTinyChunks);
  if (which == Which::all_reduce_in_place)
    col::ring_all_reduce(p2p, data.get(), data.get(), count, t, op, kTinyChunks);
  if (which == Which::reduce_scatter) col::ring_reduce_scatter(p2p, data.get(), out.get(), count, t, op, kTinyChunks);
  w.synchronize();

  const std::size_t got_count = which == Which::reduce_scatter ? mine.size : count;
  std::vector<unsigned char> raw(bytes + guard);
  w.to_host(raw.data(), which == Which::all_reduce_in_place ? data.get() : out.get(), raw.size());
  std::vector<T> got(got_count);
  std::memcpy(got.data(), raw.data(), got_count * sizeof(T));
  const std::vector<T> all = ring_order<T>(count, n, op);
  const std::size_t offset = which == Which::reduce_scatter ? mine.offset : 0;
  const std::string what = std::string(which == Which::reduce_scatter ? "reduce_scatter" : "all_reduce") +
                           (which == Which::all_reduce_in_place ? " in place" : "") + " " + kd::to_string(t) +
                           " " + kd::to_string(op) + " of " + std::to_string(count) + " on " +
                           std::to_string(n) + " ranks, rank " + std::to_string(r);
  for (std::size_t i = 0; i < got_count; ++i)
    require(std::memcmp(&got[i], &all[offset + i], sizeof(T)) == 0, what + ": element " + std::to_string(i));
  for (std::size_t i = got_count * sizeof(T); i < raw.size(); ++i)
    require(raw[i] == 0xFF, what + ": written past the end of the output");
}

template <class T>
void check_all(kd::Communicator& w, kd::DType t, kd::ReduceOp op) {
  for (std::size_t count : {0, 1, 2, 3, 5, 7, 17, 64, 1000, 4099, 20011})
    for (Which which : {Which::all_reduce, Which::all_reduce_in_place, Which::reduce_scatter})
      check<T>(w, which, t, op, count);
}

}  // namespace

int main(int argc, char** argv) {
  return kd::run(argc, argv, [](kd::Communicator& w) {
    check_all<int>(w, kd::DType::i32, kd::ReduceOp::sum);
    check_all<float>(w, kd::DType::f32, kd::ReduceOp::sum);
    check_all<double>(w, kd::DType::f64, kd::ReduceOp::sum);
    check_all<float>(w, kd::DType::f32, kd::ReduceOp::max);
    w.barrier();
    if (w.rank() == 0) std::printf("ring pipeline: forced chunks on %d ranks OK\n", w.size());
  });
}
