// k2c/testing/bench.h — Google Benchmark glue for GPU work.
//
// Benchmarks are named BM_<module>_<op>/<variant>/<size> and use manual time: every iteration
// is timed with CUDA events around the work alone, after an L2 flush (k2c::time_gpu with one
// repeat), so Google Benchmark's statistics (and its GB/s or FLOP/s counters, which are rates
// over the manual time) describe the GPU, not the host.
#pragma once

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <cuda_bf16.h>

#include "k2c/core/random.h"
#include "k2c/device/buffer.h"
#include "k2c/device/device.h"
#include "k2c/device/timing.h"

namespace k2c::bench {

// Times `work` once per benchmark iteration; `flops` and `bytes` per call become counters.
inline void run(benchmark::State& state, const std::function<void()>& work, double flops,
                double bytes) {
  work();  // warm-up: module load, first touch
  for (auto _ : state)
    state.SetIterationTime(time_gpu(work, {.warmup = 0, .repeats = 1}).median_ms * 1e-3);
  if (flops > 0)
    state.counters["TFLOP/s"] =
        benchmark::Counter(flops * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
  if (bytes > 0)
    state.counters["GB/s"] =
        benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

inline benchmark::internal::Benchmark* add(const std::string& name,
                                           std::function<void(benchmark::State&)> fn) {
  return benchmark::RegisterBenchmark(name.c_str(), std::move(fn))
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}

// The SGEMM ladder's sweep (modules 01–04): BM_<module>_sgemm/<variant>/<n> for square sizes
// from 128 to 8192, powers of two and their neighbours, random inputs, beta = 0. `gemm` is
// called as gemm(n, A, B, C) on device buffers.
inline const std::vector<int> kSgemmSizes = {128, 256, 500, 512, 1000, 1024, 2000, 2048, 4000, 4096, 8192};

inline void sgemm_sweep(const std::string& module, const std::string& variant,
                        const std::function<void(int, const float*, const float*, float*)>& gemm) {
  for (int n : kSgemmSizes) {
    add("BM_" + module + "_sgemm/" + variant + "/" + std::to_string(n),
        [n, gemm](benchmark::State& state) {
          const std::size_t nn = static_cast<std::size_t>(n) * n;
          DeviceBuffer<float> a(nn), b(nn), c(nn);
          fill_uniform_device(a.data(), nn, 1);
          fill_uniform_device(b.data(), nn, 2);
          run(state, [&] { gemm(n, a.data(), b.data(), c.data()); }, 2.0 * n * static_cast<double>(n) * n, 0);
        })
        ->Iterations(n >= 4000 ? 3 : 10);
  }
}

// The bf16 ladder's sweep (module 05), the same sizes: BM_<module>_bf16gemm/<variant>/<n>,
// C = A·Bᵀ with bf16 A, B and C; gemm(n, A, B, C) on device buffers. Sizes that are not a
// multiple of `multiple_of` are left out (Part B needs K % 8 == 0).
inline void bf16_gemm_sweep(const std::string& module, const std::string& variant,
                            const std::function<void(int, const __nv_bfloat16*,
                                                     const __nv_bfloat16*, __nv_bfloat16*)>& gemm,
                            int multiple_of = 1) {
  for (int n : kSgemmSizes) {
    if (n % multiple_of != 0) continue;
    add("BM_" + module + "_bf16gemm/" + variant + "/" + std::to_string(n),
        [n, gemm](benchmark::State& state) {
          const std::size_t nn = static_cast<std::size_t>(n) * n;
          DeviceBuffer<__nv_bfloat16> a(nn), b(nn), c(nn);
          fill_uniform_device(a.data(), nn, 1);
          fill_uniform_device(b.data(), nn, 2);
          run(state, [&] { gemm(n, a.data(), b.data(), c.data()); }, 2.0 * n * static_cast<double>(n) * n, 0);
        })
        ->Iterations(n >= 4000 ? 5 : 10);
  }
}

// main() of a benchmark program: registers through `register_all`, then runs. Without a GPU it
// says so and exits with 0, registering nothing.
inline int main(int argc, char** argv, const std::function<void()>& register_all) {
  benchmark::Initialize(&argc, argv);
  const DeviceInfo& d = device_info();
  if (!d.present) {
    std::printf("no CUDA device (%s): nothing to benchmark\n", d.reason.c_str());
    return 0;
  }
  benchmark::AddCustomContext("gpu", d.name);
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace k2c::bench
