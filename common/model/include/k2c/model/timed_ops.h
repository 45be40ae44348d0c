// k2c/model/timed_ops.h — where a step's time goes: a ForwardingOps that adds up the time spent
// in each kind of operation, in one of two ways.
//
// Alone (TimedOps(inner, sync)): on a GPU the operations are asynchronous, so each one is
// bracketed by `sync` (for the CUDA backend, a device synchronise): the figures are the time each
// operation takes on its own, launch latencies included and without the overlap a normal step
// gets, and the step runs slower while it is being timed. Use it for one profiled step next to
// the timed ones, never for the timed ones themselves.
//
// In the step (TimedOps(inner, marks)): nothing waits. Each operation is bracketed by two marks on
// the device's queue (QueueMarks; for the CUDA backend, events on its stream), and its time is
// what the GPU spent between them: while the host stays ahead of the GPU, the operation's own
// GPU time inside a step that runs as usual. Where the GPU caught up with the host during an
// operation, the wait is in that operation's time. What lies between one operation's closing mark
// and the next one's opening mark is in no one's, and between_seconds() gives its sum: the GPU
// waiting for the host to issue the next operation, and whatever was queued outside the
// operations (a communicator's all-reduces and sends on a grid of several ranks, and their waits
// for the other ranks). The marks are read when the table is (entries(), report()), which waits
// for the last of them.
//
// Each operation's host time is also kept: the part of its wall time spent before it returned
// (alone: with the GPU idle at its start). For most operations that is the CPU's cost of issuing
// the work (its kernels, their arguments, the course adapters' bookkeeping); where a step's host
// times add up to near its untimed length, the CPU, not the GPU, sets the pace. An operation that
// hands a result back to the host (the loss, a sum of squares, MoE routing's counts, upload and
// download) waits for the GPU inside the call, so its host time is its whole time.
//
// Each operation is also an NVTX range of the same name where the NVTX headers are found, so
// `nsys profile k2c_model_bench` shows the profiled step with the table's names.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "k2c/device/nvtx.h"
#include "k2c/model/forwarding_ops.h"

namespace k2c::model {

// Marks on a device's queue of work: mark() is passed once everything issued before it is done,
// seconds(from, to) is the time between two passes (it waits for `to`), reset() forgets every
// mark. The CUDA backend's: cuda_queue_marks() (cuda_ops.h).
class QueueMarks {
 public:
  virtual ~QueueMarks() = default;
  virtual int mark() = 0;
  virtual double seconds(int from, int to) = 0;
  virtual void reset() = 0;
};

class TimedOps final : public ForwardingOps {
 public:
  struct Entry {
    double seconds = 0;       // alone: synchronised start to synchronised end; in the step: between marks
    double host_seconds = 0;  // from the start until the call returned to the host
    long calls = 0;
  };
  TimedOps(Ops& inner, std::function<void()> sync) : ForwardingOps(inner), sync_(std::move(sync)) {}
  TimedOps(Ops& inner, QueueMarks& marks) : ForwardingOps(inner), marks_(&marks) {}

  const std::map<std::string, Entry>& entries() const {
    settle();
    return entries_;
  }
  // In the step: the time on the device's queue from the first operation's start to the last
  // one's end that lies between operations (see above); 0 when timing alone.
  double between_seconds() const {
    settle();
    return between_;
  }
  void reset() {
    settle();
    entries_.clear();
    between_ = 0;
    if (marks_) marks_->reset();
  }
  // A table, the most expensive operation first: seconds, share of the total, host seconds, calls.
  std::string report() const;
  // Off: every operation passes through untimed (a timer kept in a chain for one step's use).
  void enable(bool on) { enabled_ = on; }

  std::string name() const override { return inner_.name() + " (timed)"; }

 protected:
  void around(const char* what, const std::function<void()>& run) override {
    if (!enabled_) {
      run();
      return;
    }
    if (marks_) {
      const int from = marks_->mark();
      const auto t0 = std::chrono::steady_clock::now();
      {
        K2C_NVTX_RANGE(what);
        run();
      }
      const auto t1 = std::chrono::steady_clock::now();
      pending_.push_back({what, from, marks_->mark()});
      Entry& e = entries_[what];
      e.host_seconds += std::chrono::duration<double>(t1 - t0).count();
      ++e.calls;
      return;
    }
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
  struct Pending {
    std::string what;
    int from, to;
  };
  // Reads the marks of the operations timed since the last read into their entries.
  void settle() const {
    for (std::size_t i = 0; i < pending_.size(); ++i) {
      const Pending& p = pending_[i];
      entries_[p.what].seconds += marks_->seconds(p.from, p.to);
      if (i > 0) between_ += marks_->seconds(pending_[i - 1].to, p.from);
    }
    pending_.clear();
  }

  std::function<void()> sync_;
  QueueMarks* marks_ = nullptr;
  bool enabled_ = true;
  mutable std::vector<Pending> pending_;
  mutable std::map<std::string, Entry> entries_;
  mutable double between_ = 0;
};

}  // namespace k2c::model
