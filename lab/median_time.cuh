// lab/median_time.cuh — the timer of the experiments: median of `reps` CUDA-event
// timings of f() after `warmup` calls. By default back to back (no L2 flush between runs, unlike
// the graded tests' k2c::time_gpu; the experiments compare variants with each other); with
// flush_l2, a 128 MiB buffer (over twice an H200's L2) is overwritten before each timed run.
// Also the rotating rounds that compare close variants, and the difference of two bf16 outputs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

inline double median_ms(const std::function<void()>& f, int reps, int warmup = 3, bool flush_l2 = false) {
  static char* flush = nullptr;
  constexpr std::size_t kFlushBytes = std::size_t{128} << 20;
  if (flush_l2 && flush == nullptr) cudaMalloc(&flush, kFlushBytes);
  for (int i = 0; i < warmup; ++i) f();
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    if (flush_l2) cudaMemsetAsync(flush, i & 0xFF, kFlushBytes);
    cudaEventRecord(a);
    f();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Timed close to the graded tests (k2c::time_gpu): L2 emptied before each of 30 runs after 3
// warm-up calls, the median. The flush here overwrites a buffer, where k2c::time_gpu now reads one
// (which leaves no dirty lines for the timed work to write back): a memory-bound kernel's figure
// taken this way can sit a few hundredths of a ratio below its graded one (lecture 07, section 9).
// Exits with a message if anything launched failed.
inline double graded_ms(const std::function<void()>& f) {
  const double ms = median_ms(f, 30, 3, true);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    std::printf("CUDA error %s\n", cudaGetErrorString(e));
    std::exit(1);
  }
  return ms;
}

// Close variants timed against each other: `rounds` rounds of `time` applied to every variant,
// each round starting one variant later than the one before, so that none always runs right after
// another (the GPU's clock moves with what ran just before). Returns each variant's times in round
// order.
inline std::vector<std::vector<double>> rotating_rounds(const std::vector<std::function<void()>>& variants,
                                                        int rounds, const std::function<double(const std::function<void()>&)>& time) {
  std::vector<std::vector<double>> ms(variants.size());
  for (int round = 0; round < rounds; ++round)
    for (std::size_t i = 0; i < variants.size(); ++i) {
      const std::size_t v = (i + round) % variants.size();
      ms[v].push_back(time(variants[v]));
    }
  return ms;
}

// The mean of the middle two of four round times: the rounds' median, robust to one outlier.
inline double middle_mean(std::vector<double> t) {
  std::sort(t.begin(), t.end());
  return (t[t.size() / 2 - 1] + t[t.size() / 2]) / 2;
}

// The largest difference between two device arrays of n bf16 values, absolute or (relative) to
// |b|, floored at 1e-6; a NaN anywhere gives infinity.
inline float max_bf16_diff(const __nv_bfloat16* a, const __nv_bfloat16* b, std::size_t n, bool relative) {
  std::vector<__nv_bfloat16> ha(n), hb(n);
  cudaMemcpy(ha.data(), a, n * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(hb.data(), b, n * 2, cudaMemcpyDeviceToHost);
  float m = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const float x = __bfloat162float(ha[i]), y = __bfloat162float(hb[i]);
    const float d = std::fabs(x - y) / (relative ? std::max(std::fabs(y), 1e-6f) : 1.0f);
    if (!(d <= m)) m = std::isnan(d) ? INFINITY : d;
  }
  return m;
}
