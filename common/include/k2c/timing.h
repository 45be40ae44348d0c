// k2c/timing.h — timing GPU work with CUDA events.
//
// time_gpu runs `work` warmup times untimed (module loading, first-touch and clock ramp-up stay
// out of the numbers), then `repeats` times, each bracketed by its own pair of events on
// `stream`, and reports the median. Before each timed repeat it overwrites a buffer twice the
// size of L2, so every repeat starts from a cold cache, as in a real model where the previous
// layer evicted our inputs.
#pragma once

#include <functional>

#include <cuda_runtime_api.h>

namespace k2c {

struct TimingOptions {
  int warmup = 3;
  int repeats = 20;
  bool flush_l2 = true;
  cudaStream_t stream = nullptr;
};

struct Timing {
  double median_ms = 0;
  double min_ms = 0;
  double max_ms = 0;
  int repeats = 0;
};

Timing time_gpu(const std::function<void()>& work, const TimingOptions& options = {});

}  // namespace k2c
