// k2c/dist/testing.h — GoogleTest for programs that run as several ranks under mpirun.
//
// The test main (common/src/dist/test_main.cpp) starts the runtime, lets only rank 0 print and
// write the JSON report, and exposes the world communicator. Every test of a distributed module
// derives from DistTest, whose TearDown makes the ranks agree: a test fails on every rank if it
// failed on any, so rank 0's report tells the truth about all of them. Performance tests time
// with time_step (k2c/dist/timing.h, included here).
//
// The checks every distributed module's tests share (modules 12 to 19): whether the ranks hold
// the same bits (same_on_all_ranks), whether a test failed on any rank (failed_anywhere), and
// host data compared within a tolerance or bit for bit (expect_close, expect_bits). And the host
// data they are made of: inputs drawn from the run's seed, the same on every rank (random_host),
// and the blocks of rows or columns a rank's shard of a matrix holds (row_block, column_block).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "k2c/core/random.h"
#include "k2c/dist/communicator.h"
#include "k2c/dist/timing.h"
#include "k2c/testing/testing.h"

namespace k2c::dist::testing {

Communicator& world();
using ::k2c::dist::time_step;  // so tests may also say testing::time_step

class DistTest : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;
};

// Skips (on every rank alike) unless the run uses the MPI backend: the correctness tests of the
// model modules (12 on) train on the model library's CPU backend, whose tensors are host memory,
// which only MPI's collectives take. On NCCL they skip with this reason and the speed tests run.
#define K2C_REQUIRE_MPI()                                                                    \
  do {                                                                                       \
    if (::k2c::dist::testing::world().backend() != ::k2c::dist::Backend::mpi)                \
      K2C_SKIP("correctness runs on the MPI backend (the CPU model); this run uses " +       \
               ::k2c::dist::to_string(::k2c::dist::testing::world().backend()));             \
  } while (0)

// The fixture of those correctness tests: every test of it runs on MPI only, as K2C_REQUIRE_MPI.
class CpuModelTest : public DistTest {
 protected:
  void SetUp() override {
    DistTest::SetUp();
    if (IsSkipped()) return;
    K2C_REQUIRE_MPI();
  }
  static int n() { return world().size(); }
  static int r() { return world().rank(); }
};

// Skips (on every rank alike) unless the run uses the NCCL backend.
#define K2C_REQUIRE_NCCL()                                                                   \
  do {                                                                                       \
    if (::k2c::dist::testing::world().backend() != ::k2c::dist::Backend::nccl)               \
      K2C_SKIP("needs the NCCL backend (this run uses " +                                    \
               ::k2c::dist::to_string(::k2c::dist::testing::world().backend()) + ")");       \
  } while (0)

// The multi-GPU speed tests: skips (on every rank alike) unless the run uses NCCL on 2 or more
// ranks, one GPU each, outside compute-sanitizer (which slows kernels by orders of magnitude).
#define K2C_REQUIRE_GPU_RANKS()                                                                     \
  do {                                                                                              \
    K2C_REQUIRE_NCCL();                                                                             \
    if (::k2c::dist::testing::world().size() < 2)                                                   \
      K2C_SKIP("needs 2 or more GPUs, one per rank (this run has 1)");                              \
    if (::k2c::testing::sanitizing()) K2C_SKIP("timing is skipped under compute-sanitizer");        \
  } while (0)

// The counted groups a test program splits once: T is made on the first call, which is collective
// (every rank makes it in the same test), and is never destroyed, because its MPI communicators
// must not be freed after MPI_Finalize (and a grid's splits take seconds on NCCL, too long to
// repeat per test). Each call hands it out with its ledger (T::counting, a CountingCommunicator)
// emptied.
template <class T>
T& kept_groups() {
  static T* groups = new T;
  groups->counting.reset();
  return *groups;
}

// Host data: a row-major matrix of `cols` columns where a shape is needed.
using Host = std::vector<float>;

// `count` values uniform in [lo, hi), drawn from the run's seed for `tag` (seed_for, so --seed
// reaches other values): the same on every rank, so each can build the whole reference.
inline Host random_host(std::int64_t count, const std::string& tag, float lo = -1.0f, float hi = 1.0f) {
  Host v(static_cast<std::size_t>(count));
  ::k2c::fill_uniform(v, ::k2c::testing::seed_for(tag), lo, hi);
  return v;
}

// Rows [r0, r0 + nr) of a matrix with `cols` columns.
inline Host row_block(const Host& m, std::int64_t cols, std::int64_t r0, std::int64_t nr) {
  return Host(m.begin() + r0 * cols, m.begin() + (r0 + nr) * cols);
}
// Columns [c0, c0 + nc) of a matrix with `cols` columns.
inline Host column_block(const Host& m, std::int64_t cols, std::int64_t c0, std::int64_t nc) {
  const std::int64_t rows = static_cast<std::int64_t>(m.size()) / cols;
  Host out(static_cast<std::size_t>(rows * nc));
  for (std::int64_t r = 0; r < rows; ++r) std::copy_n(m.begin() + r * cols + c0, nc, out.begin() + r * nc);
  return out;
}

// Collective (every rank calls it, with as many bytes): true when every rank holds the same
// bytes. Each rank hashes its own (FNV-1a, 64 bits); the minimum and maximum of the hashes over
// the ranks are equal exactly when all agree (but for a hash collision). Through MPI, so it
// works on either backend, with host data.
bool same_on_all_ranks(const void* data, std::size_t bytes);
inline bool same_on_all_ranks(const std::vector<float>& v) {
  return same_on_all_ranks(v.data(), v.size() * sizeof(float));
}

// Collective: true when the running test has failed on any rank, so that every rank can stop
// at the same point (a rank that returns early alone would leave the others in a collective).
bool failed_anywhere();

// Fails the test, naming `what`, the count of bad elements and the first, unless every element
// is within rel·|want| + of_max·(largest finite |want|) of want. An infinite want must be met
// exactly (a fully masked attention row's +inf log-sum-exp); a NaN anywhere fails.
inline void expect_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& what,
                         double rel = 1e-4, double of_max = 1e-5) {
  ASSERT_EQ(got.size(), want.size()) << what << ": sizes differ";
  double largest = 0;
  for (float w : want)
    if (std::isfinite(w)) largest = std::max(largest, static_cast<double>(std::abs(w)));
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    const bool ok = std::isinf(w) ? g == w : std::abs(g - w) <= rel * std::abs(w) + of_max * largest;
    if (!ok && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements off, first at " << first
                     << ": got " << (bad ? got[first] : 0.0f) << ", want " << (bad ? want[first] : 0.0f)
                     << " (largest |want| " << largest << ")";
}

// Fails the test unless got and want hold the same bits (-0 is not 0, a NaN only its own bits).
inline void expect_bits(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what << ": sizes differ";
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0 && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements differ in bits, first at "
                     << first << ": got " << (bad ? got[first] : 0.0f) << ", want " << (bad ? want[first] : 0.0f);
}

}  // namespace k2c::dist::testing
