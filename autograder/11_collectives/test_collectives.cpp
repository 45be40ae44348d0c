// autograder/11_collectives/test_collectives.cpp — tests of module 11 (contract: collectives.h).
//
// Run as `mpirun -np N` for the rank counts the rubric lists, on the MPI backend (host buffers)
// and, where every rank has a GPU, on NCCL (device buffers). Each rank draws every rank's input
// from the run's seed, so the single-process reference is computed locally. Sum and max, three
// types, counts from 0 to over a million including counts not divisible by the rank count and
// counts smaller than it. Integer sums and every max must be bit-exact; floating-point sums are
// reduced in ring order, so they are held to a tolerance — and must be bit-identical on every
// rank. Speed is measured on NCCL only: the ring all-reduce's bus bandwidth against
// ncclAllReduce's at 1 GiB in the same run.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "collectives.h"
#include "k2c/core/random.h"
#include "k2c/dist/rank_witness.h"
#include "k2c/dist/testing.h"
#include "k2c/testing/testing.h"

namespace col = k2c::collectives;
namespace kd = k2c::dist;
using kd::DType;
using kd::ReduceOp;
using k2c::dist::testing::world;
using Collectives = k2c::dist::testing::DistTest;

namespace {

// Rank r's input for one case; any rank can compute any rank's input from the run's seed.
template <class T>
std::vector<T> host_input(int r, std::size_t count, DType t, const std::string& tag) {
  const std::uint64_t seed = k2c::testing::seed_for(tag + "/" + std::to_string(r));
  std::vector<T> v(count);
  for (std::size_t i = 0; i < count; ++i)
    v[i] = t == DType::i32 ? static_cast<T>(std::floor(k2c::uniform_at(seed, i, -1000.0f, 1000.0f)))
                           : static_cast<T>(k2c::uniform_at(seed, i, -1.0f, 1.0f));
  return v;
}

template <class T>
std::vector<T> reference(std::size_t count, int n, DType t, ReduceOp op, const std::string& tag) {
  std::vector<T> acc = host_input<T>(0, count, t, tag);
  for (int r = 1; r < n; ++r) {
    const std::vector<T> x = host_input<T>(r, count, t, tag);
    for (std::size_t i = 0; i < count; ++i)
      acc[i] = op == ReduceOp::sum ? static_cast<T>(acc[i] + x[i]) : std::max(acc[i], x[i]);
  }
  return acc;
}

// Every rank must hold the same bits: compare a checksum's min and max over the ranks.
template <class T>
bool identical_on_all_ranks(const std::vector<T>& v) {
  std::uint64_t h = 1469598103934665603ull;
  const auto* p = reinterpret_cast<const unsigned char*>(v.data());
  for (std::size_t i = 0; i < v.size() * sizeof(T); ++i) h = (h ^ p[i]) * 1099511628211ull;
  std::uint64_t lo = 0, hi = 0;
  MPI_Allreduce(&h, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&h, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  return lo == hi;
}

template <class T>
void expect_close(const std::vector<T>& got, const std::vector<T>& want, std::size_t offset, bool exact,
                  int n, const std::string& what) {
  ASSERT_LE(offset + got.size(), want.size());
  std::size_t bad = 0, first = got.size();
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(got[i]), w = static_cast<double>(want[offset + i]);
    // fp32 sums of n values of magnitude <= 1, added in another order: a few ulps of n.
    const double tol = exact ? 0.0 : 4.0 * n * (sizeof(T) == 4 ? 1.2e-7 : 2.3e-16);
    if (!(std::abs(g - w) <= tol)) {
      if (bad++ == 0) first = i;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " wrong element(s), first at " << first << ": got "
                     << (first < got.size() ? static_cast<double>(got[first]) : 0) << ", want "
                     << (first < got.size() ? static_cast<double>(want[offset + first]) : 0);
}

const std::vector<std::size_t>& counts() {
  static const std::vector<std::size_t> c = {0, 1, 2, 3, 5, 7, 64, 1000, 4099, (1u << 20) + 7};
  return c;
}

enum class Which { all_reduce, reduce_scatter, all_gather };

// The Communicator is one pointer away from the view a ring is given (k2c/dist/communicator.h):
// a ring must not start a collective of the library, and the backends count every one. The count
// is read once the ring's work has completed (synchronize), so that nothing it left running
// starts one afterwards unseen.
template <class F>
void by_hand(kd::Communicator& w, F&& ring) {
  const std::uint64_t before = kd::library_collectives();
  ring();
  w.synchronize();
  if (const std::uint64_t started = kd::library_collectives() - before; started != 0)
    ADD_FAILURE() << "the hand-written collective started a collective of the communication library (" << started
                  << " of them): only point-to-point sends and receives are allowed";
}

template <class T>
void check(Which which, DType t, ReduceOp op) {
  kd::Communicator& w = world();
  kd::PointToPointView p2p(w);
  const int n = w.size(), r = w.rank();
  for (std::size_t count : counts()) {
    const std::string tag = std::to_string(static_cast<int>(which)) + "/" + kd::to_string(t) + "/" +
                            kd::to_string(op) + "/" + std::to_string(count);
    SCOPED_TRACE(tag + " on " + std::to_string(n) + " ranks");
    const kd::Block mine = kd::block_of(count, n, r);
    const std::vector<T> in = host_input<T>(r, count, t, tag);
    std::vector<T> out_host;
    kd::Buffer data(w, count * sizeof(T)), out(w, count * sizeof(T) + 64);  // + guard
    std::vector<unsigned char> poison(count * sizeof(T) + 64, 0xFF);
    w.to_backend(out.get(), poison.data(), poison.size());
    if (which == Which::all_gather) {
      // Rank r contributes block r of the reference input of rank 0 ... the gathered result is
      // simply rank-ordered blocks: use the rank's own input block.
      w.to_backend(data.get(), in.data() + mine.offset, mine.size * sizeof(T));
      by_hand(w, [&] { col::ring_all_gather(p2p, data.get(), out.get(), count, t); });
    } else {
      w.to_backend(data.get(), in.data(), count * sizeof(T));
      if (which == Which::all_reduce)
        by_hand(w, [&] { col::ring_all_reduce(p2p, data.get(), out.get(), count, t, op); });
      else
        by_hand(w, [&] { col::ring_reduce_scatter(p2p, data.get(), out.get(), count, t, op); });
    }
    w.synchronize();
    const std::size_t got_count = which == Which::reduce_scatter ? mine.size : count;
    std::vector<unsigned char> raw(count * sizeof(T) + 64);
    w.to_host(raw.data(), out.get(), raw.size());
    out_host.resize(got_count);
    std::memcpy(out_host.data(), raw.data(), got_count * sizeof(T));
    std::size_t touched = 0;
    for (std::size_t i = got_count * sizeof(T); i < raw.size(); ++i) touched += raw[i] != 0xFF;
    EXPECT_EQ(touched, 0u) << "bytes written past the end of the output";

    if (which == Which::all_gather) {
      // Expected: block b comes from rank b's input.
      std::vector<T> want(count);
      for (int b = 0; b < n; ++b) {
        const kd::Block blk = kd::block_of(count, n, b);
        const std::vector<T> x = host_input<T>(b, count, t, tag);
        std::copy(x.begin() + blk.offset, x.begin() + blk.offset + blk.size, want.begin() + blk.offset);
      }
      expect_close(out_host, want, 0, true, n, "all_gather");
    } else {
      const std::vector<T> want = reference<T>(count, n, t, op, tag);
      const bool exact = t == DType::i32 || op == ReduceOp::max || n <= 2;  // 2 values: one rounding
      expect_close(out_host, want, which == Which::reduce_scatter ? mine.offset : 0, exact, n,
                   which == Which::all_reduce ? "all_reduce" : "reduce_scatter");
      if (which == Which::all_reduce) EXPECT_TRUE(identical_on_all_ranks(out_host)) << "ranks disagree";
    }
  }
}

}  // namespace

// Worth no points: it lets the grader say "not implemented yet".
using CollectivesContract = k2c::dist::testing::DistTest;
TEST_F(CollectivesContract, Implemented) {
  kd::PointToPointView p2p(world());
  kd::Buffer a(world(), 16), b(world(), 16);
  try {
    col::ring_all_reduce(p2p, a.get(), b.get(), 1, DType::f32, ReduceOp::sum);
    world().synchronize();
  } catch (const k2c::NotImplemented& e) {
    FAIL() << e.what();
  }
}

TEST_F(Collectives, AllReduceSum) {
  check<float>(Which::all_reduce, DType::f32, ReduceOp::sum);
  check<double>(Which::all_reduce, DType::f64, ReduceOp::sum);
  check<int>(Which::all_reduce, DType::i32, ReduceOp::sum);
}

TEST_F(Collectives, AllReduceMax) {
  check<float>(Which::all_reduce, DType::f32, ReduceOp::max);
  check<int>(Which::all_reduce, DType::i32, ReduceOp::max);
}

TEST_F(Collectives, ReduceScatter) {
  check<float>(Which::reduce_scatter, DType::f32, ReduceOp::sum);
  check<int>(Which::reduce_scatter, DType::i32, ReduceOp::max);
}

TEST_F(Collectives, AllGather) {
  check<float>(Which::all_gather, DType::f32, ReduceOp::sum);
  check<double>(Which::all_gather, DType::f64, ReduceOp::sum);
}

TEST_F(Collectives, AllReduceInPlace) {
  kd::Communicator& w = world();
  kd::PointToPointView p2p(w);
  const std::size_t count = 10007;
  const std::vector<int> in = host_input<int>(w.rank(), count, DType::i32, "inplace");
  kd::Buffer buf(w, count * sizeof(int));
  w.to_backend(buf.get(), in.data(), count * sizeof(int));
  by_hand(w, [&] { col::ring_all_reduce(p2p, buf.get(), buf.get(), count, DType::i32, ReduceOp::sum); });
  w.synchronize();
  std::vector<int> got(count);
  w.to_host(got.data(), buf.get(), count * sizeof(int));
  expect_close(got, reference<int>(count, w.size(), DType::i32, ReduceOp::sum, "inplace"), 0, true,
               w.size(), "in-place all_reduce");
}

// The grader's own check of the tests above (k2c/dist/rank_witness.h): one case the checker drew,
// on this rank, with its input and into its poisoned output. args: which (0 all-reduce,
// 1 reduce-scatter, 2 all-gather), dtype, op, count, in place.
namespace {
void run_case(k2c::dist::testing::RankCase& c) {
  kd::Communicator& w = world();
  kd::PointToPointView p2p(w);
  const auto t = static_cast<DType>(c.args[1]);
  const auto op = static_cast<ReduceOp>(c.args[2]);
  const auto count = static_cast<std::size_t>(c.args[3]);
  const bool in_place = c.args[4] != 0;
  // A 64-byte guard past each buffer: a case of 0 elements still allocates something, and a
  // collective that writes past its output's end (a reduce-scatter that writes every block) changes
  // the guard after the output, which fails the check below.
  kd::Buffer data(w, std::max(c.in.size(), c.out.size()) + 64), out(w, c.out.size() + 64);
  w.to_backend(data.get(), c.in.data(), c.in.size());
  w.to_backend(out.get(), c.out.data(), c.out.size());
  unsigned char* result = static_cast<unsigned char*>(in_place ? data.get() : out.get());
  const std::vector<unsigned char> guard(64, 0x5A);
  w.to_backend(result + c.out.size(), guard.data(), guard.size());
  const std::uint64_t before = kd::library_collectives();
  if (c.args[0] == 2)
    col::ring_all_gather(p2p, data.get(), out.get(), count, t);
  else if (c.args[0] == 1)
    col::ring_reduce_scatter(p2p, data.get(), out.get(), count, t, op);
  else
    col::ring_all_reduce(p2p, data.get(), in_place ? data.get() : out.get(), count, t, op);
  w.synchronize();
  w.to_host(c.out.data(), result, c.out.size());
  std::vector<unsigned char> after(guard.size());
  w.to_host(after.data(), result + c.out.size(), after.size());
  // A ring that started a library collective (by_hand above), or wrote past its output, answers
  // with its output poisoned: the checker's comparison fails it.
  if (kd::library_collectives() != before || after != guard)
    std::fill(c.out.begin(), c.out.end(), static_cast<unsigned char>(0xA5));
}
}  // namespace

K2C_RANK_WITNESS(all_reduce_sum) { run_case(c); }
K2C_RANK_WITNESS(all_reduce_max) { run_case(c); }
K2C_RANK_WITNESS(reduce_scatter) { run_case(c); }
K2C_RANK_WITNESS(all_gather) { run_case(c); }
K2C_RANK_WITNESS(all_reduce_in_place) { run_case(c); }

// Bus bandwidth of the hand ring against the library, 1 GiB of fp32, NCCL only.
using CollectivesPerf = k2c::dist::testing::DistTest;
TEST_F(CollectivesPerf, AllReduceVsNccl) {
  K2C_REQUIRE_NCCL();
  if (k2c::testing::sanitizing()) K2C_SKIP("timing is skipped under compute-sanitizer");
  kd::Communicator& w = world();
  // One rank moves nothing: bus bandwidth ((n − 1)/n of the bytes over the time) is 0 for both.
  if (w.size() < 2) K2C_SKIP("needs 2 or more GPUs (this run has 1): an all-reduce on one rank moves nothing");
  kd::PointToPointView p2p(w);
  const std::size_t bytes = std::size_t{1} << 30, count = bytes / sizeof(float);
  kd::Buffer a(w, bytes), b(w, bytes);
  std::vector<float> host(count);
  k2c::fill_uniform(host, 7 + w.rank());
  w.to_backend(a.get(), host.data(), bytes);

  // Median over ranks-synchronised repeats of (issue + complete), the slowest rank's time.
  auto time = [&](const std::function<void()>& op) {
    return kd::time_step(w, op, {.warmup = 3, .repeats = 15}).median_ms;
  };
  const double lib_ms = time([&] { w.all_reduce(a.get(), b.get(), count, DType::f32, ReduceOp::sum); });
  const double ring_ms =
      time([&] { by_hand(w, [&] { col::ring_all_reduce(p2p, a.get(), b.get(), count, DType::f32, ReduceOp::sum); }); });
  const int n = w.size();
  // The ring's timed output, at fresh positions: the sum of every rank's input.
  std::vector<float> result(count);
  w.to_host(result.data(), b.get(), bytes);
  std::mt19937_64 fresh(std::random_device{}());
  std::size_t wrong = 0;
  for (int s = 0; s < 1024; ++s) {
    const std::size_t i = fresh() % count;
    double sum = 0;
    for (int r = 0; r < n; ++r) sum += k2c::uniform_at(7 + r, i, -1.0f, 1.0f);
    wrong += !(std::abs(result[i] - sum) <= 1e-5 * n);
  }
  EXPECT_EQ(wrong, 0u) << "the timed ring all-reduce's output is wrong";
  const double factor = 2.0 * (n - 1) / n;  // all-reduce's bus bandwidth factor
  const double ring_busbw = bytes / (ring_ms * 1e-3) * factor / 1e9, lib_busbw = bytes / (lib_ms * 1e-3) * factor / 1e9;
  if (w.rank() == 0)
    K2C_EXPECT_PERF(ring_busbw, lib_busbw, "1 GiB fp32 on " + std::to_string(n) + " GPUs; ring " +
                                               std::to_string(ring_ms) + " ms, NCCL " + std::to_string(lib_ms) + " ms");
}
