// k2c/model/timed_ops.h — where a step's time goes: a ForwardingOps that adds up the wall time
// spent in each kind of operation.
//
// On a GPU the operations are asynchronous, so each one is bracketed by `sync` (for the CUDA
// backend, a device synchronise): the figures are the time each operation takes on its own,
// without the overlap a normal step gets, and the step runs slower while it is being timed.
// Use it for one profiled step next to the timed ones, never for the timed ones themselves.
//
// Each operation's host time is also kept: the part of its wall time spent before it returned,
// with the GPU idle at its start. For most operations that is the CPU's cost of issuing the work
// (its kernels, their arguments, the course adapters' bookkeeping); where a step's host times add
// up to near its untimed length, the CPU, not the GPU, sets the pace. An operation that hands a
// result back to the host (the loss, a sum of squares, MoE routing's counts, upload and
// download) waits for the GPU inside the call, so its host time is its whole time.
//
// Each operation is also an NVTX range of the same name where the NVTX headers are found, so
// `nsys profile k2c_model_bench` shows the profiled step with the table's names.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <string>

#include "k2c/device/nvtx.h"
#include "k2c/model/forwarding_ops.h"

namespace k2c::model {

class TimedOps final : public ForwardingOps {
 public:
  struct Entry {
    double seconds = 0;       // from a synchronised start to a synchronised end
    double host_seconds = 0;  // from the same start until the call returned to the host
    long calls = 0;
  };
  TimedOps(Ops& inner, std::function<void()> sync) : ForwardingOps(inner), sync_(std::move(sync)) {}

  const std::map<std::string, Entry>& entries() const { return entries_; }
  void reset() { entries_.clear(); }
  // A table, the most expensive operation first: seconds, share of the total, host seconds, calls.
  std::string report() const;

  std::string name() const override { return inner_.name() + " (timed)"; }

 protected:
  void around(const char* what, const std::function<void()>& run) override {
    sync_();
    const auto t0 = std::chrono::steady_clock::now();
    {
      K2C_NVTX_RANGE(what);  // the same names on an nsys timeline as in the table
      run();
    }
    const auto t1 = std::chrono::steady_clock::now();
    sync_();
    Entry& e = entries_[what];
    e.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    e.host_seconds += std::chrono::duration<double>(t1 - t0).count();
    ++e.calls;
  }

 private:
  std::function<void()> sync_;
  std::map<std::string, Entry> entries_;
};

}  // namespace k2c::model
