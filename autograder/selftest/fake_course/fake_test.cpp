// fake_test.cpp — one GoogleTest program, built once per misbehaviour (FAKE_MODE_<name>).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <csignal>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "k2c/core/todo.h"

TEST(Fake, Correct) {
#if FAKE_MODE_crash
  std::raise(SIGSEGV);
#elif FAKE_MODE_hang
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
#elif FAKE_MODE_exit0
  std::exit(0);  // "all good" — before GoogleTest could write its report
#elif FAKE_MODE_sticky
  std::fprintf(stderr, "K2C_FATAL: sticky CUDA error after Fake.Correct: an illegal memory access was encountered\n");
  std::fflush(nullptr);
  std::_Exit(3);
#elif FAKE_MODE_notimpl
  K2C_TODO("write the kernel");
#elif FAKE_MODE_noisy
  // 50 MiB of lines that are not UTF-8: a byte 0xFF, then 511 "³" (two bytes each). The two bytes
  // first shift them so that the grader's kept head ends inside a "³".
  std::string line = "\xff";
  for (int i = 0; i < 511; ++i) line += "\xc2\xb3";
  std::fputs("xx", stdout);
  for (int i = 0; i < 50 * 1024; ++i) std::puts(line.c_str());
#endif
  SUCCEED();
}

TEST(FakePerf, Rate) {
#if FAKE_MODE_notimpl
  K2C_TODO("write the kernel");
#endif
#if FAKE_MODE_impossible
  const double achieved = 500;  // 5× a ceiling that is a physical limit
#else
  const double achieved = 80;
#endif
  RecordProperty("k2c_achieved", std::to_string(achieved));
  RecordProperty("k2c_ceiling", "100");
}
