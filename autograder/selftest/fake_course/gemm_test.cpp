// gemm_test.cpp — the test program of the fake submission modules (90_honest ... 97_rubric).
// Compiled once and linked with each module's implementation library.
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include <gtest/gtest.h>

#include "fake_gemm.h"

TEST(Fake, Correct) { EXPECT_EQ(k2c::gemm::answer(), 42); }

// Reads the rubric the grader handed over, as the course's harness reads its thresholds: a
// rubric rewritten by an earlier module's code would fail it.
TEST(FakePerf, Rate) {
  const char* path = std::getenv("K2C_RUBRIC");
  ASSERT_NE(path, nullptr) << "K2C_RUBRIC is not set";
  std::ifstream in(path);
  const std::string rubric((std::istreambuf_iterator<char>(in)), {});
  ASSERT_NE(rubric.find("FakePerf.Rate"), std::string::npos) << path << " is not the course's rubric";
  ASSERT_EQ(k2c::gemm::answer(), 42);
  RecordProperty("k2c_achieved", "80");
  RecordProperty("k2c_ceiling", "100");
}

TEST(FakeBonus, Extra) { EXPECT_EQ(k2c::gemm::answer(), 42); }
