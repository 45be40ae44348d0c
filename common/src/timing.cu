// timing.cu — see k2c/timing.h.
#include <algorithm>
#include <vector>

#include <cuda_runtime.h>

#include "k2c/buffer.h"
#include "k2c/check.h"
#include "k2c/device.h"
#include "k2c/nvtx.h"
#include "k2c/timing.h"

namespace k2c {

// One scratch buffer per process, twice the L2, written (not just read) so dirty lines of the
// work under test are evicted too.
static DeviceBuffer<char>& l2_flush_buffer() {
  static DeviceBuffer<char> buf(std::max<std::size_t>(2 * device_info().l2_bytes, 1 << 20));
  return buf;
}

Timing time_gpu(const std::function<void()>& work, const TimingOptions& o) {
  K2C_CHECK(o.repeats >= 1 && o.warmup >= 0,
            "time_gpu needs repeats >= 1 and warmup >= 0, got " << o.repeats << ", " << o.warmup);
  K2C_NVTX_RANGE("k2c::time_gpu");
  for (int i = 0; i < o.warmup; ++i) work();
  K2C_CUDA_CHECK(cudaStreamSynchronize(o.stream));

  cudaEvent_t start, stop;
  K2C_CUDA_CHECK(cudaEventCreate(&start));
  K2C_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> ms(o.repeats);
  for (int i = 0; i < o.repeats; ++i) {
    if (o.flush_l2) {
      DeviceBuffer<char>& buf = l2_flush_buffer();
      K2C_CUDA_CHECK(cudaMemsetAsync(buf.data(), i & 0xFF, buf.bytes(), o.stream));
    }
    K2C_CUDA_CHECK(cudaEventRecord(start, o.stream));
    work();
    K2C_CUDA_CHECK(cudaEventRecord(stop, o.stream));
    K2C_CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    K2C_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms[i] = t;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  K2C_CUDA_CHECK(cudaGetLastError());  // an asynchronous fault in `work` must not pass unseen

  std::sort(ms.begin(), ms.end());
  Timing t;
  t.repeats = o.repeats;
  t.min_ms = ms.front();
  t.max_ms = ms.back();
  t.median_ms = o.repeats % 2 ? ms[o.repeats / 2] : 0.5 * (ms[o.repeats / 2 - 1] + ms[o.repeats / 2]);
  return t;
}

}  // namespace k2c
