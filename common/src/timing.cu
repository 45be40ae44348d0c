// timing.cu — see k2c/device/timing.h.
#include <algorithm>
#include <chrono>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/device/buffer.h"
#include "k2c/device/device.h"
#include "k2c/device/nvtx.h"
#include "k2c/device/timing.h"

namespace k2c {

// One scratch buffer per process, twice the L2, filled once and then only read.
static DeviceBuffer<char>& l2_flush_buffer() {
  static DeviceBuffer<char> buf = [] {
    DeviceBuffer<char> b(std::max<std::size_t>(2 * device_info().l2_bytes, 1 << 20));
    K2C_CUDA_CHECK(cudaMemset(b.data(), 0x5A, b.bytes()));
    return b;
  }();
  return buf;
}

// The flush reads the buffer through L2: every line the previous work left there is evicted, the
// dirty ones written back now, outside the timed window, and L2 ends up holding clean lines of the
// buffer, which cost nothing to drop. Writing the buffer instead (a memset) would evict the work's
// lines just as well but leave up to a whole L2 of dirty lines that the next timed run must write
// back to memory: on an H200, 60 MB of extra traffic billed to the work, a few percent of a
// memory-bound kernel's time. The loads feed a value that is stored only if it equals one nobody
// can produce, so the compiler must keep them.
__global__ void read_through_l2(const uint4* p, std::size_t n, unsigned* never) {
  unsigned acc = 0;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u && never != nullptr) *never = acc;
}

void flush_l2(cudaStream_t stream) {
  DeviceBuffer<char>& buf = l2_flush_buffer();
  read_through_l2<<<4 * device_info().sms, 256, 0, stream>>>(reinterpret_cast<const uint4*>(buf.data()),
                                                              buf.bytes() / sizeof(uint4), nullptr);
  K2C_CUDA_CHECK(cudaGetLastError());
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

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// What a device-wide synchronize costs on an idle device: the median of a few, once per process.
double idle_sync_ms() {
  static const double ms = [] {
    K2C_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<double> t;
    for (int i = 0; i < 9; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      K2C_CUDA_CHECK(cudaDeviceSynchronize());
      t.push_back(ms_since(t0));
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }();
  return ms;
}

// One timed repeat: the L2 flush, then `work` between events; with whole_device, plus the time
// the device still ran after the stop event.
double time_once(const std::function<void()>& work, const TimingOptions& o, const EventPair& ev) {
  if (o.flush_l2) flush_l2(o.stream);
  K2C_CUDA_CHECK(cudaEventRecord(ev.start, o.stream));
  work();
  K2C_CUDA_CHECK(cudaEventRecord(ev.stop, o.stream));
  K2C_CUDA_CHECK(cudaEventSynchronize(ev.stop));
  float t = 0;
  K2C_CUDA_CHECK(cudaEventElapsedTime(&t, ev.start, ev.stop));
  if (!o.whole_device) return t;
  const double idle = idle_sync_ms();
  const auto t0 = std::chrono::steady_clock::now();
  K2C_CUDA_CHECK(cudaDeviceSynchronize());
  return t + std::max(0.0, ms_since(t0) - idle);
}

// The warm-up calls, each after its `before`, and the device left idle (with whole_device, on
// every stream).
void warm_up(const std::vector<const std::function<void()>*>& works, const TimingOptions& o, std::vector<int>& calls) {
  for (int i = 0; i < o.warmup; ++i)
    for (std::size_t w = 0; w < works.size(); ++w) {
      if (o.before) o.before(w, calls[w]++);
      (*works[w])();
    }
  K2C_CUDA_CHECK(cudaStreamSynchronize(o.stream));
  if (o.whole_device) {
    K2C_CUDA_CHECK(cudaDeviceSynchronize());
    idle_sync_ms();  // measured now, on an idle device, not inside the first timed repeat
  }
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
  std::vector<int> calls(1, 0);
  warm_up({&work}, o, calls);
  std::vector<double> ms(o.repeats);
  {
    const EventPair ev;
    for (int i = 0; i < o.repeats; ++i) {
      if (o.before) o.before(0, calls[0]++);
      ms[i] = time_once(work, o, ev);
    }
  }
  K2C_CUDA_CHECK(cudaGetLastError());  // an asynchronous fault in `work` must not pass unseen
  return summarize(std::move(ms));
}

std::vector<Timing> time_gpu_interleaved(const std::vector<std::function<void()>>& works,
                                         const TimingOptions& o) {
  check_options("time_gpu_interleaved", o);
  K2C_CHECK(!works.empty(), "time_gpu_interleaved needs at least one piece of work, got none");
  K2C_NVTX_RANGE("k2c::time_gpu_interleaved");
  std::vector<const std::function<void()>*> pointers;
  for (const auto& work : works) pointers.push_back(&work);
  std::vector<int> calls(works.size(), 0);
  warm_up(pointers, o, calls);
  std::vector<std::vector<double>> ms(works.size(), std::vector<double>(o.repeats));
  {
    const EventPair ev;
    for (int i = 0; i < o.repeats; ++i)
      for (std::size_t w = 0; w < works.size(); ++w) {
        if (o.before) o.before(w, calls[w]++);
        ms[w][i] = time_once(works[w], o, ev);
      }
  }
  K2C_CUDA_CHECK(cudaGetLastError());
  std::vector<Timing> out;
  for (auto& m : ms) out.push_back(summarize(std::move(m)));
  return out;
}

}  // namespace k2c
