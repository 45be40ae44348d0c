// testing.cpp — see k2c/testing/testing.h.
#include "k2c/testing/testing.h"

#include <malloc.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>

#include "k2c/core/random.h"
#if K2C_HAS_CUDA
#include "k2c/device/device.h"
#include "k2c/testing/witness.h"
#endif

namespace k2c::testing {

static Context& mutable_context() {
  static Context c;
  return c;
}
const Context& context() { return mutable_context(); }
void set_context(Context c) { mutable_context() = std::move(c); }

Context context_from_env(const char* module_id, const char* impl, const char* default_rubric) {
  Context c;
  c.module_id = module_id;
  c.impl = impl;
  const char* rubric = std::getenv("K2C_RUBRIC");
  c.rubric_path = rubric && *rubric ? rubric : default_rubric;
  const char* seed = std::getenv("K2C_SEED");
  c.seed = seed && *seed ? std::strtoull(seed, nullptr, 10) : 20261129ull;
  return c;
}

std::vector<RowShape> random_row_shapes(std::uint64_t seed, int count, int max_cols, int max_elements) {
  std::mt19937_64 rng(seed);
  std::vector<RowShape> shapes;
  for (int i = 0; i < count; ++i) {
    const int cols = 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(max_cols));
    shapes.push_back({1 + static_cast<int>(rng() % static_cast<std::uint64_t>(std::max(1, max_elements / cols))), cols});
  }
  return shapes;
}

std::uint64_t unpredictable_seed() {
  static std::random_device device;
  return (std::uint64_t{device()} << 32) ^ device();
}

std::uint64_t seed_for(const std::string& purpose) {
  std::uint64_t h = mix64(context().seed);
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string key = info ? std::string(info->test_suite_name()) + "." + info->name() : "";
  key += "/" + purpose;
  for (unsigned char c : key) h = mix64(h ^ c);
  return h;
}

std::size_t heap_in_use() {
#if defined(__GLIBC__) && __GLIBC_PREREQ(2, 33)
  const struct mallinfo2 m = mallinfo2();
#else  // mallinfo's fields are int: right below 2 GiB, which the tests that read it stay under
  const struct mallinfo m = mallinfo();
#endif
  return static_cast<std::size_t>(m.uordblks) + static_cast<std::size_t>(m.hblkhd);
}

bool gpu_available() {
#if K2C_HAS_CUDA
  return device_info().present;
#else
  return false;
#endif
}

std::string gpu_name() {
#if K2C_HAS_CUDA
  return device_info().present ? device_info().name : "";
#else
  return "";
#endif
}

std::string gpu_unavailable_reason() {
#if K2C_HAS_CUDA
  return device_info().reason;
#else
  return "built without a CUDA toolkit";
#endif
}

int serve_witness_if_asked(int argc, char** argv) {
  const std::string flag = "--k2c_witness=";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind(flag, 0) != 0) continue;
#if K2C_HAS_CUDA
    return serve_witness(arg.substr(flag.size()));
#else
    std::fprintf(stderr, "built without a CUDA toolkit: no witness runs\n");
    return 2;
#endif
  }
  return -1;
}

bool sanitizing() {
  const char* s = std::getenv("K2C_SANITIZE");
  return s != nullptr && std::string(s) == "1";
}

const TestSpec* current_test_spec() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name = std::string(info->test_suite_name()) + "." + info->name();
  try {
    static const Rubric rubric = load_rubric(context().rubric_path);
    const ModuleSpec* m = rubric.find(context().module_id);
    const TestSpec* t = m ? m->find_test(name) : nullptr;
    if (t == nullptr)
      ADD_FAILURE() << "no rubric entry for " << context().module_id << " / " << name << " in "
                    << context().rubric_path;
    return t;
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
    return nullptr;
  }
}

::testing::AssertionResult check_perf(double achieved, double ceiling, const std::string& detail) {
  const TestSpec* spec = current_test_spec();
  if (spec == nullptr || !spec->perf)
    return ::testing::AssertionFailure() << "the rubric gives this test no perf entry";
  const PerfSpec& p = *spec->perf;
  const double ratio = ceiling > 0 ? achieved / ceiling : 0;
  const double bar = p.required(context().impl);
  using ::testing::Test;
  auto exact = [](double v) {  // all 17 digits: small figures must not round to 0
    std::ostringstream os;
    os.precision(17);
    os << v;
    return os.str();
  };
  Test::RecordProperty("k2c_achieved", exact(achieved));
  Test::RecordProperty("k2c_ceiling", exact(ceiling));
  Test::RecordProperty("k2c_ceiling_name", p.ceiling);
  Test::RecordProperty("k2c_unit", p.unit);
  Test::RecordProperty("k2c_ratio", exact(ratio));
  Test::RecordProperty("k2c_required", exact(bar));
  if (!detail.empty()) Test::RecordProperty("k2c_detail", detail);

  std::ostringstream os;
  os.precision(4);
  os << achieved << " " << p.unit << " = " << ratio << " of " << p.ceiling << " (" << ceiling
     << " " << p.unit << " measured in this run); required " << bar << " ("
     << PerfSpec::required_name(context().impl) << ")";
  if (!detail.empty()) os << "; " << detail;
  std::printf("[ k2c perf ] %s\n", os.str().c_str());
  if (!(ceiling > 0) || !(achieved > 0))
    return ::testing::AssertionFailure() << "no valid measurement: " << os.str();
  if (ratio > p.max_ratio)
    return ::testing::AssertionFailure()
           << "impossible result, above the physical limit of " << p.max_ratio
           << " × the ceiling: " << os.str();
  if (ratio < bar) return ::testing::AssertionFailure() << "too slow: " << os.str();
  return ::testing::AssertionSuccess() << os.str();
}

}  // namespace k2c::testing
