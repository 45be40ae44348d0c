// k2c/dist/timing.h — time_step: the one way distributed performance tests time a step.
//
//   const TimingResult step = time_step(world, [&] { ddp.step(batch); }, {.warmup = 3, .repeats = 15});
//   const double speed = no_sync.median_ms / step.median_ms;  // the same on every rank
//
// A step is as slow as its slowest rank (the others wait for it at the next collective), so each
// repeat starts at a barrier, is timed on every rank, and counts as the maximum over the ranks;
// the result is the median of those maxima (robust to one repeat hit by a noisy neighbour).
// fn() may return before its work is done (NCCL queues it): the clock stops after
// synchronize(). Every rank gets the same numbers, so every rank may compare them.
#pragma once

#include <functional>
#include <vector>

#include "k2c/dist/communicator.h"

namespace k2c::dist {

struct TimeStepOptions {
  int warmup = 3;    // untimed runs first (lazy set-up, NCCL's first-call connection, caches)
  int repeats = 15;  // timed runs; >= 1
};

struct TimingResult {
  double median_ms = 0;               // median over repeats of the slowest rank's time
  double min_ms = 0, max_ms = 0;      // fastest and slowest repeat (each a max over ranks)
  std::vector<double> repeat_ms;      // each repeat's slowest-rank time, in the order run
};

// Collective over `c`: every rank calls it with the same options. Runs fn() warmup times (each
// followed by synchronize()), then barrier(); then per repeat: barrier(), clock, fn(),
// synchronize(), clock. The repeats' times are reduced with one all_reduce max over `c` at the
// end, so no extra exchange runs between repeats. Throws std::invalid_argument if repeats < 1.
TimingResult time_step(Communicator& c, const std::function<void()>& fn, TimeStepOptions options = {});

}  // namespace k2c::dist
