// autograder/19_inference/step_cost.h — the serving tests' cost model, shared with k2c_inference
// (--cost), so that a schedule the benchmark prints takes the times the tests assert.
//
// In seconds: a prefill costs a launch and its prompt tokens, a decode a launch, its sequences
// and the cache it reads, a transfer its bytes at 10 GB/s.
#pragma once

#include "inference.h"

namespace k2c::inference_testing {

inline double step_cost(const k2c::inference::StepInfo& s) {
  using Kind = k2c::inference::StepInfo::Kind;
  switch (s.kind) {
    case Kind::prefill: return 0.010 + 0.001 * double(s.tokens);
    case Kind::decode: return 0.004 + 0.0005 * s.sequences + 1e-5 * double(s.context);
    case Kind::transfer: return 0.002 + 1e-10 * double(s.bytes);
  }
  return 0;
}

}  // namespace k2c::inference_testing
