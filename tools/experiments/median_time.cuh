// tools/experiments/median_time.cuh — the timer of the experiments: median of `reps` CUDA-event
// timings of f() after three warm-up calls, back to back (no L2 flush between runs, unlike the
// graded tests' k2c::time_gpu; the experiments compare variants with each other).
#pragma once

#include <algorithm>
#include <functional>
#include <vector>

#include <cuda_runtime.h>

inline double median_ms(const std::function<void()>& f, int reps) {
  for (int i = 0; i < 3; ++i) f();
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
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
