// autograder/04_register_tiled_matmul/tune_register_tiled_matmul.cu — the module 04 tuner.
//
//   k2c_tune_04_register_tiled_matmul [--size N] [--repeats R] [--out tuned_config.h]
//
// Times every tile configuration of the implementation at N³ (default 4096) on this GPU, each
// checked at random positions against the CPU reference first, prints them beside cuBLAS SGEMM
// measured in the same run, and writes the fastest correct one into tuned_config.h (`make tune`
// points --out at the tree being built). Rebuild afterwards: the choice is a compile-time
// constant.
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "k2c/buffer.h"
#include "k2c/ceilings.h"
#include "k2c/compare.h"
#include "k2c/device.h"
#include "k2c/random.h"
#include "k2c/reference.h"
#include "k2c/timing.h"
#include "register_tiled_matmul.h"

namespace rt = k2c::register_tiled_matmul;

int main(int argc, char** argv) {
  int n = 4096, repeats = 10;
  std::string out;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--size" && i + 1 < argc) n = std::atoi(argv[++i]);
    else if (a == "--repeats" && i + 1 < argc) repeats = std::atoi(argv[++i]);
    else if (a == "--out" && i + 1 < argc) out = argv[++i];
    else {
      std::fprintf(stderr, "usage: %s [--size N] [--repeats R] [--out tuned_config.h]\n", argv[0]);
      return 2;
    }
  }
  const k2c::DeviceInfo& d = k2c::device_info();
  if (!d.present) {
    std::fprintf(stderr, "no CUDA device (%s): nothing to tune\n", d.reason.c_str());
    return 1;
  }
  try {
    const std::size_t nn = static_cast<std::size_t>(n) * n;
    std::vector<float> A(nn), B(nn);
    k2c::fill_uniform(A, 11);
    k2c::fill_uniform(B, 12);
    k2c::DeviceBuffer<float> dA{std::span<const float>(A)}, dB{std::span<const float>(B)}, dC(nn);
    const double flops = 2.0 * n * static_cast<double>(n) * n;
    const double cublas = k2c::sgemm_rate(n);
    std::printf("tuning on %s at %d^3; cuBLAS SGEMM %.2f TFLOP/s\n", d.name.c_str(), n, cublas / 1e12);

    // Sample positions checked for every configuration.
    std::mt19937_64 rng(13);
    std::vector<std::size_t> where;
    std::vector<double> want;
    const std::vector<float> no_c;
    for (int s = 0; s < 256; ++s) {
      const int r = static_cast<int>(rng() % n), c = static_cast<int>(rng() % n);
      where.push_back(static_cast<std::size_t>(r) * n + c);
      want.push_back(k2c::ref::gemm_at(n, n, 1.0, A, B, 0.0, no_c, r, c));
    }

    int best = -1;
    double best_rate = 0;
    for (int i = 0; i < rt::config_count(); ++i) {
      const std::string name = rt::config(i).name();
      dC.poison();
      rt::matmul_config(i, n, n, n, 1.0f, dA.data(), dB.data(), 0.0f, dC.data());
      const std::vector<float> all = dC.download();
      std::vector<float> got;
      for (std::size_t w : where) got.push_back(all[w]);
      const auto report = k2c::compare_sampled(got, want, where, k2c::gemm_tolerance(n, 1, 0), n);
      if (!report.ok) {
        std::printf("  [%2d] %-36s WRONG: %s\n", i, name.c_str(), report.summary().c_str());
        continue;
      }
      const k2c::Timing t = k2c::time_gpu(
          [&] { rt::matmul_config(i, n, n, n, 1.0f, dA.data(), dB.data(), 0.0f, dC.data()); },
          {.warmup = 2, .repeats = repeats});
      const double rate = flops / (t.median_ms * 1e-3);
      std::printf("  [%2d] %-36s %7.2f TFLOP/s  %5.1f%% of cuBLAS\n", i, name.c_str(), rate / 1e12,
                  100 * rate / cublas);
      if (rate > best_rate) best = i, best_rate = rate;
    }
    if (best < 0) {
      std::fprintf(stderr, "no configuration computed the right answer\n");
      return 1;
    }
    std::printf("best: [%d] %s, %.2f TFLOP/s = %.1f%% of cuBLAS\n", best, rt::config(best).name().c_str(),
                best_rate / 1e12, 100 * best_rate / cublas);
    if (!out.empty()) {
      char date[32];
      const std::time_t now = std::time(nullptr);
      std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
      std::ofstream f(out);
      f << "// tuned_config.h — the configuration matmul() uses; written by the tuner (make tune).\n"
        << "// " << d.name << ", " << n << "^3, " << date << ": " << rt::config(best).name() << ", "
        << static_cast<int>(best_rate / 1e9) / 1000.0 << " TFLOP/s = "
        << static_cast<int>(1000 * best_rate / cublas) / 10.0 << "% of cuBLAS SGEMM in the same run.\n"
        << "#pragma once\nnamespace k2c::register_tiled_matmul {\ninline constexpr int kTunedConfig = "
        << best << ";\n}  // namespace k2c::register_tiled_matmul\n";
      if (!f) throw std::runtime_error("cannot write " + out);
      std::printf("wrote %s (rebuild to use it)\n", out.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
