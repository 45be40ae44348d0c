// k2c/device/timing.h — timing GPU work with CUDA events.
//
// time_gpu runs `work` warmup times untimed (module loading, first-touch and clock ramp-up stay
// out of the numbers), then `repeats` times, each bracketed by its own pair of events on
// `stream`, and reports the median. Before each timed repeat it reads a buffer twice the size of
// L2, so every repeat starts from a cold cache, as in a real model where the previous layer
// evicted our inputs, and with nothing dirty left in L2 for the timed work to write back.
//
// time_gpu_interleaved times several pieces of work in turn, one repeat of each (a, b, a, b, ...),
// each repeat as time_gpu's, and reports each one's median. A ratio of two rates timed one after
// the other carries whatever the clocks and power limit did in between: under sustained load an
// H200's rate drifts by several percent within a second (lecture 10, section 11). Alternating
// repeat by repeat lands that drift on both sides of the ratio alike.
#pragma once

#include <functional>
#include <vector>

#include <cuda_runtime_api.h>

namespace k2c {

struct TimingOptions {
  int warmup = 3;
  int repeats = 20;
  bool flush_l2 = true;
  cudaStream_t stream = nullptr;
  // Called before every call of a piece of work, warm-up and timed, off the clock (before the L2
  // flush): `work` is its index in time_gpu_interleaved's list (0 for time_gpu), `call` how many
  // calls of it came before. A test that gives each call inputs of its own makes them here, so
  // that no call's inputs exist before the call that reads them.
  std::function<void(std::size_t work, int call)> before;
  // Time each repeat until the whole device is idle, not only `stream`: after the stop event, a
  // device-wide synchronize, and the time it took beyond an idle device's (measured once) is
  // added to the repeat. Work that code under test left running on a stream of its own, which
  // the events on `stream` do not see, is then on the clock, all but what overlapped the L2
  // flush before the start event or finished while the host woke from the stop event (tens of
  // microseconds: a sync before the start would bill the work's own launch instead).
  bool whole_device = false;
};

struct Timing {
  double median_ms = 0;
  double min_ms = 0;
  double max_ms = 0;
  int repeats = 0;
};

Timing time_gpu(const std::function<void()>& work, const TimingOptions& options = {});

// What time_gpu does before each timed repeat: reads a buffer twice the size of L2 on `stream`,
// leaving L2 clean and holding nothing of earlier work (the grader's witness run uses it too).
void flush_l2(cudaStream_t stream = nullptr);

// One Timing per entry of `works`, in their order: options.warmup untimed rounds, then
// options.repeats timed rounds, each round running every piece of work once in the given order.
std::vector<Timing> time_gpu_interleaved(const std::vector<std::function<void()>>& works,
                                         const TimingOptions& options = {});

}  // namespace k2c
