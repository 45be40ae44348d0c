// timing.cu — see k2c/device/timing.h.
#include <algorithm>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/device/buffer.h"
#include "k2c/device/device.h"
#include "k2c/device/nvtx.h"
#include "k2c/device/timing.h"

namespace k2c {

// One scratch buffer per process, twice the L2, written (not just read) so dirty lines of the
// work under test are evicted too.
static DeviceBuffer<char>& l2_flush_buffer() {
  static DeviceBuffer<char> buf(std::max<std::size_t>(2 * device_info().l2_bytes, 1 << 20));
  return buf;
}

namespace {

struct EventPair {
  cudaEvent_t start{}, stop{};
  EventPair() {
    K2C_CUDA_CHECK(cudaEventCreate(&start));
    K2C_CUDA_CHECK(cudaEventCreate(&stop));
  }
  ~EventPair() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
};

void check_options(const char* who, const TimingOptions& o) {
  K2C_CHECK(o.repeats >= 1 && o.warmup >= 0,
            who << " needs repeats >= 1 and warmup >= 0, got " << o.repeats << ", " << o.warmup);
}

// One timed repeat: the L2 flush (its byte value varies with `i`), then `work` between events.
double time_once(const std::function<void()>& work, int i, const TimingOptions& o, const EventPair& ev) {
  if (o.flush_l2) {
    DeviceBuffer<char>& buf = l2_flush_buffer();
    K2C_CUDA_CHECK(cudaMemsetAsync(buf.data(), i & 0xFF, buf.bytes(), o.stream));
  }
  K2C_CUDA_CHECK(cudaEventRecord(ev.start, o.stream));
  work();
  K2C_CUDA_CHECK(cudaEventRecord(ev.stop, o.stream));
  K2C_CUDA_CHECK(cudaEventSynchronize(ev.stop));
  float t = 0;
  K2C_CUDA_CHECK(cudaEventElapsedTime(&t, ev.start, ev.stop));
  return t;
}

Timing summarize(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  const int n = static_cast<int>(ms.size());
  Timing t;
  t.repeats = n;
  t.min_ms = ms.front();
  t.max_ms = ms.back();
  t.median_ms = n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
  return t;
}

}  // namespace

Timing time_gpu(const std::function<void()>& work, const TimingOptions& o) {
  check_options("time_gpu", o);
  K2C_NVTX_RANGE("k2c::time_gpu");
  for (int i = 0; i < o.warmup; ++i) work();
  K2C_CUDA_CHECK(cudaStreamSynchronize(o.stream));
  std::vector<double> ms(o.repeats);
  {
    const EventPair ev;
    for (int i = 0; i < o.repeats; ++i) ms[i] = time_once(work, i, o, ev);
  }
  K2C_CUDA_CHECK(cudaGetLastError());  // an asynchronous fault in `work` must not pass unseen
  return summarize(std::move(ms));
}

std::vector<Timing> time_gpu_interleaved(const std::vector<std::function<void()>>& works,
                                         const TimingOptions& o) {
  check_options("time_gpu_interleaved", o);
  K2C_CHECK(!works.empty(), "time_gpu_interleaved needs at least one piece of work, got none");
  K2C_NVTX_RANGE("k2c::time_gpu_interleaved");
  for (int i = 0; i < o.warmup; ++i)
    for (const auto& work : works) work();
  K2C_CUDA_CHECK(cudaStreamSynchronize(o.stream));
  std::vector<std::vector<double>> ms(works.size(), std::vector<double>(o.repeats));
  {
    const EventPair ev;
    for (int i = 0; i < o.repeats; ++i)
      for (std::size_t w = 0; w < works.size(); ++w) ms[w][i] = time_once(works[w], i, o, ev);
  }
  K2C_CUDA_CHECK(cudaGetLastError());
  std::vector<Timing> out;
  for (auto& m : ms) out.push_back(summarize(std::move(m)));
  return out;
}

}  // namespace k2c
