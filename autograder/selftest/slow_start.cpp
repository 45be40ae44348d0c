// slow_start.cpp — a test program that takes longer to start than CMake's default discovery
// limit (5 s) allows: what a program linking the CUDA libraries does on a cold disk.
//
// It is registered with k2c_discover_tests like every module's test program. If discovery ever
// falls back to a short limit, listing this program's tests fails and CTest stops before running
// anything, so `make test` fails here first, on any machine, however warm its disk.
#include <chrono>
#include <cstring>
#include <thread>

#include <gtest/gtest.h>

TEST(SlowStart, DiscoveredDespiteASlowStart) { SUCCEED(); }

int main(int argc, char** argv) {
  // Only the listing is slowed: that is the run the discovery limit applies to, and running the
  // test itself need not cost the suite the same seconds again.
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--gtest_list_tests") == 0)
      std::this_thread::sleep_for(std::chrono::seconds(8));
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
