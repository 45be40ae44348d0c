// k2c/dist/testing.h — GoogleTest for programs that run as several ranks under mpirun.
//
// The test main (common/src/dist/test_main.cpp) starts the runtime, lets only rank 0 print and
// write the JSON report, and exposes the world communicator. Every test of a distributed module
// derives from DistTest, whose TearDown makes the ranks agree: a test fails on every rank if it
// failed on any, so rank 0's report tells the truth about all of them. Performance tests time
// with time_step (k2c/dist/timing.h, included here).
#pragma once

#include <gtest/gtest.h>

#include "k2c/dist/communicator.h"
#include "k2c/dist/timing.h"
#include "k2c/testing.h"

namespace k2c::dist::testing {

Communicator& world();
using ::k2c::dist::time_step;  // so tests may also say testing::time_step

class DistTest : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;
};

// Skips (on every rank alike) unless the run uses the NCCL backend.
#define K2C_REQUIRE_NCCL()                                                                   \
  do {                                                                                       \
    if (::k2c::dist::testing::world().backend() != ::k2c::dist::Backend::nccl)               \
      K2C_SKIP("needs the NCCL backend (this run uses " +                                    \
               ::k2c::dist::to_string(::k2c::dist::testing::world().backend()) + ")");       \
  } while (0)

}  // namespace k2c::dist::testing
