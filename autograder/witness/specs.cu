// specs.cu — the witnesses k2c_witness knows (see specs.h). Shapes are those of the performance
// tests they witness; inputs are drawn as the tests draw theirs (k2c/core/random.h), so a CPU
// reference recomputes any element from the seed alone.
#include "specs.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <memory>
#include <stdexcept>
#include <cstring>
#include <span>

#include <cuda_bf16.h>

#include "k2c/core/random.h"
#include "k2c/device/device.h"
#include "k2c/reference/moe_baseline.h"
#include "k2c/reference/reference.h"
#include "k2c/testing/compare.h"

namespace k2c::witness_specs {
namespace {

using bf16 = __nv_bfloat16;

// The seed of buffer `b` of a launch whose seed is `seed`.
std::uint64_t buffer_seed(std::uint64_t seed, int b) { return mix64(seed ^ (0x517CC1B727220A95ull * (b + 1))); }

float bf16_at(std::uint64_t seed, std::uint64_t i, float lo, float hi) {
  return __bfloat162float(__float2bfloat16(uniform_at(seed, i, lo, hi)));
}

float read_bf16(const char* p) {
  bf16 v;
  std::memcpy(&v, p, sizeof v);
  return __bfloat162float(v);
}

// What a fill keeps on the host for the check of the same launch (seed → value): the copy in the
// shared buffers is the test program's to overwrite. The last 64 launches' are kept, twice a
// window's worth, so a check always finds the launches of its own window.
template <class T>
class Kept {
 public:
  void put(std::uint64_t seed, T value) {
    if (order_.size() == 64) {
      values_.erase(order_.front());
      order_.pop_front();
    }
    order_.push_back(seed);
    values_[seed] = std::move(value);
  }
  const T& at(std::uint64_t seed) const { return values_.at(seed); }

 private:
  std::map<std::uint64_t, T> values_;
  std::deque<std::uint64_t> order_;
};

// Module 00: a 1 GiB copy, fp32, checked bit for bit on 16 runs of 4,096 elements.
Spec copy() {
  constexpr std::int64_t n = std::int64_t{1} << 28;
  constexpr std::uint64_t run = 4096;
  Spec s;
  s.name = "copy";
  s.shape = {n};
  s.buffers = {{n * sizeof(float), false}, {n * sizeof(float), true}};
  s.work = 2.0 * n * sizeof(float);
  s.unit = "GB/s";
  s.fill = [](const std::vector<char*>& p, std::uint64_t seed) {
    fill_uniform_device(reinterpret_cast<float*>(p[0]), n, buffer_seed(seed, 0));
  };
  s.sample = [](std::mt19937_64& rng) {
    std::vector<Range> r;
    for (int k = 0; k < 16; ++k) r.push_back({1, (rng() % (n - run)) * sizeof(float), run * sizeof(float)});
    return r;
  };
  s.check = [](std::uint64_t seed, const std::vector<Range>& ranges, const std::vector<const char*>& bytes) {
    for (std::size_t k = 0; k < ranges.size(); ++k) {
      const std::uint64_t first = ranges[k].offset / sizeof(float);
      for (std::uint64_t i = 0; i < ranges[k].bytes / sizeof(float); ++i) {
        float got;
        std::memcpy(&got, bytes[k] + i * sizeof(float), sizeof got);
        const float want = uniform_at(buffer_seed(seed, 0), first + i, -1.0f, 1.0f);
        if (!(got == want))
          return "dst[" + std::to_string(first + i) + "] = " + std::to_string(got) + ", expected " + std::to_string(want);
      }
    }
    return std::string();
  };
  return s;
}

// Module 06: softmax of 16,384 rows of 4,096 bf16 logits in [-8, 8), four whole rows checked.
Spec softmax_fast() {
  constexpr std::int64_t rows = 16384, cols = 4096, n = rows * cols;
  Spec s;
  s.name = "softmax_fast";
  s.shape = {rows, cols};
  s.buffers = {{n * sizeof(bf16), false}, {n * sizeof(bf16), true}};
  s.work = 2.0 * n * sizeof(bf16);
  s.unit = "GB/s";
  s.fill = [](const std::vector<char*>& p, std::uint64_t seed) {
    fill_uniform_device(reinterpret_cast<bf16*>(p[0]), n, buffer_seed(seed, 0), -8.0f, 8.0f);
  };
  s.sample = [](std::mt19937_64& rng) {
    std::vector<Range> r;
    for (int k = 0; k < 4; ++k) r.push_back({1, (rng() % rows) * cols * sizeof(bf16), cols * sizeof(bf16)});
    return r;
  };
  s.check = [](std::uint64_t seed, const std::vector<Range>& ranges, const std::vector<const char*>& bytes) {
    for (std::size_t k = 0; k < ranges.size(); ++k) {
      const std::int64_t row = static_cast<std::int64_t>(ranges[k].offset / (cols * sizeof(bf16)));
      std::vector<float> x(cols), got(cols);
      for (std::int64_t j = 0; j < cols; ++j) {
        x[j] = bf16_at(buffer_seed(seed, 0), row * cols + j, -8.0f, 8.0f);
        got[j] = read_bf16(bytes[k] + j * sizeof(bf16));
      }
      // The tolerance of module 06's tests for bf16 output.
      const CompareReport c = compare(got, ref::softmax_rows(x, 1, cols), {1e-30, 4.5e-3, 4e-3});
      if (!c.ok) return "row " + std::to_string(row) + ": " + c.summary();
    }
    return std::string();
  };
  return s;
}

// Module 05: C = A·Bᵀ at 8192³ in bf16 (fp32 accumulation), 32 elements checked. An element's
// error is its bf16 rounding (2⁻⁸ of its size) plus fp32 rounding over 8,192 products, far below
// the error of a wrong or missing element (the size of the element itself).
Spec bf16_gemm(const std::string& name) {
  constexpr std::int64_t n = 8192, nn = n * n;
  Spec s;
  s.name = name;
  s.shape = {n};
  s.buffers = {{nn * sizeof(bf16), false}, {nn * sizeof(bf16), false}, {nn * sizeof(bf16), true}};
  s.work = 2.0 * n * n * n;
  s.unit = "TFLOP/s";
  s.unit_scale = 1e12;
  s.fill = [](const std::vector<char*>& p, std::uint64_t seed) {
    fill_uniform_device(reinterpret_cast<bf16*>(p[0]), nn, buffer_seed(seed, 0));
    fill_uniform_device(reinterpret_cast<bf16*>(p[1]), nn, buffer_seed(seed, 1));
  };
  s.sample = [](std::mt19937_64& rng) {
    std::vector<Range> r;
    for (int k = 0; k < 32; ++k) r.push_back({2, (rng() % nn) * sizeof(bf16), sizeof(bf16)});
    return r;
  };
  s.check = [](std::uint64_t seed, const std::vector<Range>& ranges, const std::vector<const char*>& bytes) {
    for (std::size_t k = 0; k < ranges.size(); ++k) {
      const std::int64_t at = static_cast<std::int64_t>(ranges[k].offset / sizeof(bf16)), r = at / n, c = at % n;
      double want = 0, magnitude = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        const double p = static_cast<double>(bf16_at(buffer_seed(seed, 0), r * n + i, -1.0f, 1.0f)) *
                         bf16_at(buffer_seed(seed, 1), c * n + i, -1.0f, 1.0f);
        want += p;
        magnitude += std::fabs(p);
      }
      const double got = read_bf16(bytes[k]);
      if (!(std::fabs(got - want) <= 0x1p-7 * std::fabs(want) + 2e-4 * magnitude))
        return "C[" + std::to_string(r) + "][" + std::to_string(c) + "] = " + std::to_string(got) + ", expected " +
               std::to_string(want);
    }
    return std::string();
  };
  return s;
}

// Module 00: the FMA chains of roofline.h (kFmaChains = 8 chains per element starting at
// x + j/8, each x = fma(x, 0.999, 0.001) 4,096 times, then summed), in place on two waves of
// threads of this GPU; 32 elements per launch replayed on the CPU.
Spec fma() {
  constexpr int iters = 4096, chains = 8;
  constexpr float step = 0.125f, mul = 0.999f, add = 0.001f;
  const std::int64_t n = static_cast<std::int64_t>(device_info().sms) * 2048 * 2;
  Spec s;
  s.name = "fma";
  s.shape = {n, iters};
  s.buffers = {{n * sizeof(float), false}};  // updated in place: filled, never poisoned
  s.work = 2.0 * chains * iters * static_cast<double>(n);
  s.unit = "TFLOP/s";
  s.unit_scale = 1e12;
  s.fill = [n](const std::vector<char*>& p, std::uint64_t seed) {
    fill_uniform_device(reinterpret_cast<float*>(p[0]), n, buffer_seed(seed, 0));
  };
  s.sample = [n](std::mt19937_64& rng) {
    std::vector<Range> r;
    for (int k = 0; k < 32; ++k) r.push_back({0, (rng() % n) * sizeof(float), sizeof(float)});
    return r;
  };
  s.check = [](std::uint64_t seed, const std::vector<Range>& ranges, const std::vector<const char*>& bytes) {
    for (std::size_t k = 0; k < ranges.size(); ++k) {
      const std::uint64_t i = ranges[k].offset / sizeof(float);
      const float start = uniform_at(buffer_seed(seed, 0), i, -1.0f, 1.0f);
      const double want = ref::fma_chains(std::span<const float>(&start, 1), iters, chains, step, mul, add)[0];
      float got;
      std::memcpy(&got, bytes[k], sizeof got);
      if (!(std::fabs(got - want) <= 1e-5 * std::fabs(want) + 1e-6))
        return "out[" + std::to_string(i) + "] = " + std::to_string(got) + ", expected " + std::to_string(want);
    }
    return std::string();
  };
  return s;
}

// Modules 01–04: C = A·B in fp32 at 4096³, row-major, alpha 1 and beta 0, 32 elements checked.
// Rounding over 4,096 products stays far below 4e-5 of the sum of their sizes, and a wrong
// element is off by the size of the element (about 20).
Spec sgemm_4096() {
  constexpr std::int64_t n = 4096, nn = n * n;
  Spec s;
  s.name = "sgemm_4096";
  s.shape = {n};
  s.buffers = {{nn * sizeof(float), false}, {nn * sizeof(float), false}, {nn * sizeof(float), true}};
  s.work = 2.0 * n * n * n;
  s.unit = "TFLOP/s";
  s.unit_scale = 1e12;
  s.max_sets = 8;  // the naive kernel takes about 0.1 s a launch
  s.fill = [](const std::vector<char*>& p, std::uint64_t seed) {
    fill_uniform_device(reinterpret_cast<float*>(p[0]), nn, buffer_seed(seed, 0));
    fill_uniform_device(reinterpret_cast<float*>(p[1]), nn, buffer_seed(seed, 1));
  };
  s.sample = [](std::mt19937_64& rng) {
    std::vector<Range> r;
    for (int k = 0; k < 32; ++k) r.push_back({2, (rng() % nn) * sizeof(float), sizeof(float)});
    return r;
  };
  s.check = [](std::uint64_t seed, const std::vector<Range>& ranges, const std::vector<const char*>& bytes) {
    for (std::size_t k = 0; k < ranges.size(); ++k) {
      const std::int64_t at = static_cast<std::int64_t>(ranges[k].offset / sizeof(float)), r = at / n, c = at % n;
      double want = 0, magnitude = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        const double p = static_cast<double>(uniform_at(buffer_seed(seed, 0), r * n + i, -1.0f, 1.0f)) *
                         uniform_at(buffer_seed(seed, 1), i * n + c, -1.0f, 1.0f);
        want += p;
        magnitude += std::fabs(p);
      }
      float got;
      std::memcpy(&got, bytes[k], sizeof got);
      if (!(std::fabs(got - want) <= 4e-5 * magnitude))
        return "C[" + std::to_string(r) + "][" + std::to_string(c) + "] = " + std::to_string(got) + ", expected " +
               std::to_string(want);
    }
    return std::string();
  };
  return s;
}

// A sample check of bf16 rows: "" or "<what> <row>: <mismatch>".
std::string compare_row(const char* what, std::int64_t row, const char* bytes, const std::vector<double>& want,
                        Tolerance tol) {
  std::vector<float> got(want.size());
  for (std::size_t j = 0; j < want.size(); ++j) got[j] = read_bf16(bytes + j * sizeof(bf16));
  const CompareReport c = compare(got, want, tol);
  return c.ok ? std::string() : std::string(what) + " " + std::to_string(row) + ": " + c.summary();
}

// Module 07: RMSNorm of 16,384 rows of 4,096 (eps 1e-5, no residual), with the tolerances of the
// module's tests.
constexpr std::int64_t kNormRows = 16384, kNormCols = 4096;
constexpr double kNormEps = 1e-5;
constexpr Tolerance kNormOut{1e-4, 4.5e-3, 4e-3}, kNormRstd{0, 2e-5, 1e-5};

std::vector<float> norm_row(std::uint64_t seed, int buffer, std::int64_t row, float lo, float hi) {
  std::vector<float> x(kNormCols);
  for (std::int64_t j = 0; j < kNormCols; ++j) x[j] = bf16_at(buffer_seed(seed, buffer), row * kNormCols + j, lo, hi);
  return x;
}

std::vector<float> norm_gamma(std::uint64_t seed) { return norm_row(seed, 1, 0, 0.5f, 1.5f); }

Spec rmsnorm_forward() {
  constexpr std::int64_t n = kNormRows * kNormCols;
  Spec s;
  s.name = "rmsnorm_forward";
  s.shape = {kNormRows, kNormCols};
  // h, gamma; y, rstd
  s.buffers = {{n * sizeof(bf16), false}, {kNormCols * sizeof(bf16), false}, {n * sizeof(bf16), true},
               {kNormRows * sizeof(float), true}};
  s.work = 2.0 * n * sizeof(bf16);
  s.unit = "GB/s";
  s.fill = [](const std::vector<char*>& p, std::uint64_t seed) {
    fill_uniform_device(reinterpret_cast<bf16*>(p[0]), n, buffer_seed(seed, 0), -2.0f, 2.0f);
    fill_uniform_device(reinterpret_cast<bf16*>(p[1]), kNormCols, buffer_seed(seed, 1), 0.5f, 1.5f);
  };
  s.sample = [](std::mt19937_64& rng) {
    std::vector<Range> r;
    for (int k = 0; k < 4; ++k) {
      const std::uint64_t row = rng() % kNormRows;
      r.push_back({2, row * kNormCols * sizeof(bf16), kNormCols * sizeof(bf16)});
      r.push_back({3, row * sizeof(float), sizeof(float)});
    }
    return r;
  };
  s.check = [](std::uint64_t seed, const std::vector<Range>& ranges, const std::vector<const char*>& bytes) {
    const std::vector<float> gamma = norm_gamma(seed);
    for (std::size_t k = 0; k + 1 < ranges.size(); k += 2) {
      const std::int64_t row = static_cast<std::int64_t>(ranges[k + 1].offset / sizeof(float));
      const ref::RmsNormForward want = ref::rmsnorm_forward(norm_row(seed, 0, row, -2.0f, 2.0f), gamma, 1, kNormCols, kNormEps);
      if (std::string p = compare_row("y row", row, bytes[k], want.y, kNormOut); !p.empty()) return p;
      float rstd;
      std::memcpy(&rstd, bytes[k + 1], sizeof rstd);
      if (const CompareReport c = compare(std::vector<float>{rstd}, want.rstd, kNormRstd); !c.ok)
        return "rstd of row " + std::to_string(row) + ": " + c.summary();
    }
    return std::string();
  };
  return s;
}

// The rstd of each row of a bf16 matrix, for the backward pass's input: one block per row.
__global__ void row_rstd(const bf16* h, float* rstd, int cols, double eps) {
  __shared__ double partial[256];
  double sum = 0;
  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    const double v = __bfloat162float(h[static_cast<std::int64_t>(blockIdx.x) * cols + j]);
    sum += v * v;
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) rstd[blockIdx.x] = static_cast<float>(1.0 / sqrt(partial[0] / cols + eps));
}

Spec rmsnorm_backward() {
  constexpr std::int64_t n = kNormRows * kNormCols;
  Spec s;
  s.name = "rmsnorm_backward";
  s.shape = {kNormRows, kNormCols};
  // h, gamma, dy, rstd; dx, dgamma
  s.buffers = {{n * sizeof(bf16), false},         {kNormCols * sizeof(bf16), false}, {n * sizeof(bf16), false},
               {kNormRows * sizeof(float), false}, {n * sizeof(bf16), true},          {kNormCols * sizeof(float), true}};
  s.work = 3.0 * n * sizeof(bf16);
  s.unit = "GB/s";
  // rstd is computed from h here, and kept on the host for the check: the copy in the shared
  // buffers is the test program's to overwrite.
  auto kept = std::make_shared<Kept<std::vector<float>>>();
  s.fill = [kept](const std::vector<char*>& p, std::uint64_t seed) {
    fill_uniform_device(reinterpret_cast<bf16*>(p[0]), n, buffer_seed(seed, 0), -2.0f, 2.0f);
    fill_uniform_device(reinterpret_cast<bf16*>(p[1]), kNormCols, buffer_seed(seed, 1), 0.5f, 1.5f);
    fill_uniform_device(reinterpret_cast<bf16*>(p[2]), n, buffer_seed(seed, 2), -1.0f, 1.0f);
    float* rstd = nullptr;
    if (cudaMalloc(&rstd, kNormRows * sizeof(float)) != cudaSuccess) throw std::runtime_error("cudaMalloc of rstd failed");
    row_rstd<<<kNormRows, 256>>>(reinterpret_cast<const bf16*>(p[0]), rstd, kNormCols, kNormEps);
    std::vector<float> host(kNormRows);
    const cudaError_t e = cudaMemcpy(host.data(), rstd, kNormRows * sizeof(float), cudaMemcpyDeviceToHost);
    cudaMemcpy(p[3], rstd, kNormRows * sizeof(float), cudaMemcpyDeviceToDevice);
    cudaFree(rstd);
    if (e != cudaSuccess) throw std::runtime_error(std::string("rstd: ") + cudaGetErrorString(e));
    kept->put(seed, std::move(host));
  };
  s.sample = [](std::mt19937_64& rng) {
    std::vector<Range> r;
    for (int k = 0; k < 4; ++k) r.push_back({4, (rng() % kNormRows) * kNormCols * sizeof(bf16), kNormCols * sizeof(bf16)});
    for (int k = 0; k < 4; ++k) r.push_back({5, (rng() % kNormCols) * sizeof(float), sizeof(float)});
    return r;
  };
  s.check = [kept](std::uint64_t seed, const std::vector<Range>& ranges, const std::vector<const char*>& bytes) {
    const std::vector<float> gamma = norm_gamma(seed);
    const std::vector<float>& rstd = kept->at(seed);
    for (std::size_t k = 0; k < ranges.size(); ++k) {
      if (ranges[k].buffer == 4) {
        const std::int64_t row = static_cast<std::int64_t>(ranges[k].offset / (kNormCols * sizeof(bf16)));
        const ref::RmsNormBackward want = ref::rmsnorm_backward(
            norm_row(seed, 0, row, -2.0f, 2.0f), gamma, norm_row(seed, 2, row, -1.0f, 1.0f), 1, kNormCols, kNormEps);
        if (std::string p = compare_row("dx row", row, bytes[k], want.dx, kNormOut); !p.empty()) return p;
        continue;
      }
      const std::int64_t col = static_cast<std::int64_t>(ranges[k].offset / sizeof(float));
      double want = 0;
      for (std::int64_t r = 0; r < kNormRows; ++r)
        want += static_cast<double>(bf16_at(buffer_seed(seed, 2), r * kNormCols + col, -1.0f, 1.0f)) *
                bf16_at(buffer_seed(seed, 0), r * kNormCols + col, -2.0f, 2.0f) * rstd[r];
      float got;
      std::memcpy(&got, bytes[k], sizeof got);
      // The tolerance of module 07's tests for dgamma summed over this many rows.
      if (!(std::fabs(got - want) <= 1e-6 + 2.4e-7 * kNormRows + 1e-5 * std::fabs(want)))
        return "dgamma[" + std::to_string(col) + "] = " + std::to_string(got) + ", expected " + std::to_string(want);
    }
    return std::string();
  };
  return s;
}

// Module 08: RoPE on Llama-sized q and k (4 × 4,096 tokens, 32 query and 8 key heads of 128,
// half-split pairs, base 10,000), with the table (`rope_cache`) or without (`rope_on_the_fly`);
// four tokens of q and k checked.
constexpr std::int64_t kRopeBatch = 4, kRopeSeq = 4096, kRopeQHeads = 32, kRopeKHeads = 8, kRopeDim = 128;
constexpr double kRopeBase = 10000.0;

Spec rope(bool cache) {
  constexpr std::int64_t tokens = kRopeBatch * kRopeSeq, nq = tokens * kRopeQHeads * kRopeDim,
                         nk = tokens * kRopeKHeads * kRopeDim, pairs = kRopeSeq * kRopeDim / 2;
  Spec s;
  s.name = cache ? "rope_cache" : "rope_on_the_fly";
  s.shape = {kRopeBatch, kRopeSeq, kRopeQHeads, kRopeKHeads, kRopeDim};
  // q, k; q_out, k_out; the cos/sin table
  s.buffers = {{nq * sizeof(bf16), false}, {nk * sizeof(bf16), false}, {nq * sizeof(bf16), true}, {nk * sizeof(bf16), true}};
  if (cache) s.buffers.push_back({pairs * 2 * sizeof(float), false});
  s.work = 2.0 * (nq + nk) * sizeof(bf16);
  s.unit = "GB/s";
  s.fill = [cache](const std::vector<char*>& p, std::uint64_t seed) {
    fill_uniform_device(reinterpret_cast<bf16*>(p[0]), nq, buffer_seed(seed, 0));
    fill_uniform_device(reinterpret_cast<bf16*>(p[1]), nk, buffer_seed(seed, 1));
    if (!cache) return;
    static const std::vector<float> table = [] {  // as build_cache's contract has it: double, stored as fp32
      std::vector<float> t(pairs * 2);
      for (std::int64_t pos = 0; pos < kRopeSeq; ++pos)
        for (std::int64_t i = 0; i < kRopeDim / 2; ++i) {
          const double angle = pos * std::pow(kRopeBase, -2.0 * i / kRopeDim);
          t[2 * (pos * kRopeDim / 2 + i)] = static_cast<float>(std::cos(angle));
          t[2 * (pos * kRopeDim / 2 + i) + 1] = static_cast<float>(std::sin(angle));
        }
      return t;
    }();
    if (cudaMemcpy(p[4], table.data(), table.size() * sizeof(float), cudaMemcpyHostToDevice) != cudaSuccess)
      throw std::runtime_error("cannot upload the cos/sin table");
  };
  s.sample = [](std::mt19937_64& rng) {
    std::vector<Range> r;
    for (int k = 0; k < 4; ++k) {
      const std::uint64_t token = rng() % tokens;
      r.push_back({2, token * kRopeQHeads * kRopeDim * sizeof(bf16), kRopeQHeads * kRopeDim * sizeof(bf16)});
      r.push_back({3, token * kRopeKHeads * kRopeDim * sizeof(bf16), kRopeKHeads * kRopeDim * sizeof(bf16)});
    }
    return r;
  };
  s.check = [](std::uint64_t seed, const std::vector<Range>& ranges, const std::vector<const char*>& bytes) {
    for (std::size_t k = 0; k < ranges.size(); ++k) {
      const bool is_q = ranges[k].buffer == 2;
      const std::int64_t heads = is_q ? kRopeQHeads : kRopeKHeads, len = heads * kRopeDim;
      const std::int64_t token = static_cast<std::int64_t>(ranges[k].offset / (len * sizeof(bf16)));
      std::vector<float> in(len);
      for (std::int64_t j = 0; j < len; ++j) in[j] = bf16_at(buffer_seed(seed, is_q ? 0 : 1), token * len + j, -1.0f, 1.0f);
      const std::vector<double> want = ref::rope(in, 1, static_cast<int>(heads), kRopeDim, token % kRopeSeq, kRopeBase,
                                                 ref::RopeLayout::half_split, false);
      // The tolerance of module 08's tests.
      if (std::string p = compare_row(is_q ? "q of token" : "k of token", token, bytes[k], want, {1e-3, 4.5e-3, 4e-3});
          !p.empty())
        return p;
    }
    return std::string();
  };
  return s;
}

// Module 09: causal attention forward at B 4, 32 heads, 4,096 tokens, d 128 (the graded shape),
// inputs as the module's tests draw them; two query rows of o and their lse checked per launch,
// each against the reference over exactly the keys it sees, within the tests' bounds.
constexpr std::int64_t kAttnBatch = 4, kAttnHeads = 32, kAttnLen = 4096, kAttnDim = 128;

Spec attention_forward(const std::string& name) {
  constexpr std::int64_t rows = kAttnBatch * kAttnHeads * kAttnLen, n = rows * kAttnDim;
  const double scale = 1.0f / std::sqrt(static_cast<float>(kAttnDim));  // as the tests' make_shape rounds it
  Spec s;
  s.name = name;
  s.shape = {kAttnBatch, kAttnHeads, kAttnHeads, kAttnLen, kAttnLen, kAttnDim, 1};
  // q, k, v; o, lse
  s.buffers = {{n * sizeof(bf16), false}, {n * sizeof(bf16), false}, {n * sizeof(bf16), false},
               {n * sizeof(bf16), true},  {rows * sizeof(float), true}};
  s.work = 4.0 * kAttnBatch * kAttnHeads * static_cast<double>(kAttnLen) * kAttnLen * kAttnDim * 0.5;
  s.unit = "TFLOP/s";
  s.unit_scale = 1e12;
  s.max_sets = 16;
  s.fill = [](const std::vector<char*>& p, std::uint64_t seed) {
    fill_uniform_device(reinterpret_cast<bf16*>(p[0]), n, buffer_seed(seed, 0), -2.0f, 2.0f);
    fill_uniform_device(reinterpret_cast<bf16*>(p[1]), n, buffer_seed(seed, 1), -2.0f, 2.0f);
    fill_uniform_device(reinterpret_cast<bf16*>(p[2]), n, buffer_seed(seed, 2), -1.0f, 1.0f);
  };
  s.sample = [](std::mt19937_64& rng) {
    std::vector<Range> r;
    for (int t = 0; t < 2; ++t) {
      const std::uint64_t row = rng() % rows;
      r.push_back({3, row * kAttnDim * sizeof(bf16), kAttnDim * sizeof(bf16)});
      r.push_back({4, row * sizeof(float), sizeof(float)});
    }
    return r;
  };
  s.check = [scale](std::uint64_t seed, const std::vector<Range>& ranges, const std::vector<const char*>& bytes) {
    for (std::size_t t = 0; t + 1 < ranges.size(); t += 2) {
      const std::int64_t row = static_cast<std::int64_t>(ranges[t + 1].offset / sizeof(float));
      const std::int64_t i = row % kAttnLen, head_row = row / kAttnLen;  // (batch, head), kv head = head
      const std::int64_t seen = i + 1;
      std::vector<float> q(kAttnDim), k(seen * kAttnDim), v(seen * kAttnDim);
      for (std::int64_t c = 0; c < kAttnDim; ++c) q[c] = bf16_at(buffer_seed(seed, 0), row * kAttnDim + c, -2.0f, 2.0f);
      const std::int64_t kv0 = head_row * kAttnLen * kAttnDim;
      for (std::int64_t j = 0; j < seen * kAttnDim; ++j) {
        k[j] = bf16_at(buffer_seed(seed, 1), kv0 + j, -2.0f, 2.0f);
        v[j] = bf16_at(buffer_seed(seed, 2), kv0 + j, -1.0f, 1.0f);
      }
      const ref::AttentionForward want =
          ref::attention_forward(q, k, v, {1, 1, 1, 1, static_cast<int>(seen), static_cast<int>(kAttnDim), false, scale});
      for (std::int64_t c = 0; c < kAttnDim; ++c) {
        const double got = read_bf16(bytes[t] + c * sizeof(bf16));
        // The bound of module 09's tests: a bf16 rounding of every intermediate, with a margin.
        const double bound = 1.25 * std::ldexp(want.o_magnitude[c] + std::fabs(want.o[c]), -8) + 1e-5;
        if (!(std::fabs(got - want.o[c]) <= bound))
          return "o[row " + std::to_string(row) + "][" + std::to_string(c) + "] = " + std::to_string(got) + ", expected " +
                 std::to_string(want.o[c]);
      }
      float lse;
      std::memcpy(&lse, bytes[t + 1], sizeof lse);
      if (!(std::fabs(lse - want.lse[0]) <= 1e-4 + kAttnLen * 6e-8 + 1e-6 * std::fabs(want.lse[0])))
        return "lse[row " + std::to_string(row) + "] = " + std::to_string(lse) + ", expected " + std::to_string(want.lse[0]);
    }
    return std::string();
  };
  return s;
}

// Module 10: the routed experts' up projection at the module's shape (16,384 tokens, each to 6 of
// 64 experts picked uniformly, [g|u] = x·W13ᵀ with n = 2 × 1,408 and k = 2,048), loads drawn
// afresh for every launch; 32 elements of C checked.
constexpr int kMoeTokens = 16384, kMoeExperts = 64, kMoeTopK = 6, kMoeN = 2 * 1408, kMoeK = 2048;

Spec moe_up_projection() {
  constexpr std::int64_t rows = static_cast<std::int64_t>(kMoeTokens) * kMoeTopK;
  Spec s;
  s.name = "moe_up_projection";
  s.shape = {kMoeExperts, rows, kMoeN, kMoeK};
  // a, b (every expert's weight), offsets; c
  s.buffers = {{rows * kMoeK * sizeof(bf16), false},
               {static_cast<std::size_t>(kMoeExperts) * kMoeN * kMoeK * sizeof(bf16), false},
               {(kMoeExperts + 1) * sizeof(int), false},
               {rows * kMoeN * sizeof(bf16), true}};
  s.work = 2.0 * rows * static_cast<double>(kMoeN) * kMoeK;
  s.unit = "TFLOP/s";
  s.unit_scale = 1e12;
  s.max_sets = 8;
  // The offsets are kept here for the check: the copy in the shared buffers is the test
  // program's to overwrite.
  auto kept = std::make_shared<Kept<std::vector<int>>>();
  s.fill = [kept](const std::vector<char*>& p, std::uint64_t seed) {
    fill_uniform_device(reinterpret_cast<bf16*>(p[0]), rows * kMoeK, buffer_seed(seed, 0));
    fill_uniform_device(reinterpret_cast<bf16*>(p[1]), static_cast<std::size_t>(kMoeExperts) * kMoeN * kMoeK,
                        buffer_seed(seed, 1));
    const std::vector<int> counts = baseline::expert_loads(kMoeTokens, kMoeExperts, kMoeTopK, false, buffer_seed(seed, 2));
    std::vector<int> offsets(kMoeExperts + 1, 0);
    for (int e = 0; e < kMoeExperts; ++e) offsets[e + 1] = offsets[e] + counts[e];
    if (offsets.back() != rows) throw std::runtime_error("expert_loads: rows do not add up");
    if (cudaMemcpy(p[2], offsets.data(), offsets.size() * sizeof(int), cudaMemcpyHostToDevice) != cudaSuccess)
      throw std::runtime_error("cannot upload the offsets");
    kept->put(seed, offsets);
  };
  s.sample = [](std::mt19937_64& rng) {
    std::vector<Range> r;
    for (int t = 0; t < 32; ++t) r.push_back({3, (rng() % (rows * kMoeN)) * sizeof(bf16), sizeof(bf16)});
    return r;
  };
  s.check = [kept](std::uint64_t seed, const std::vector<Range>& ranges, const std::vector<const char*>& bytes) {
    const std::vector<int>& offsets = kept->at(seed);
    for (std::size_t t = 0; t < ranges.size(); ++t) {
      const std::int64_t at = static_cast<std::int64_t>(ranges[t].offset / sizeof(bf16)), r = at / kMoeN, c = at % kMoeN;
      const std::int64_t e = std::upper_bound(offsets.begin(), offsets.end(), static_cast<int>(r)) - offsets.begin() - 1;
      double want = 0, magnitude = 0;
      for (std::int64_t i = 0; i < kMoeK; ++i) {
        const double p = static_cast<double>(bf16_at(buffer_seed(seed, 0), r * kMoeK + i, -1.0f, 1.0f)) *
                         bf16_at(buffer_seed(seed, 1), (e * kMoeN + c) * kMoeK + i, -1.0f, 1.0f);
        want += p;
        magnitude += std::fabs(p);
      }
      const double got = read_bf16(bytes[t]);
      if (!(std::fabs(got - want) <= 0x1p-7 * std::fabs(want) + 2e-4 * magnitude))
        return "C[" + std::to_string(r) + "][" + std::to_string(c) + "] (expert " + std::to_string(e) +
               ") = " + std::to_string(got) + ", expected " + std::to_string(want);
    }
    return std::string();
  };
  return s;
}

// Module 19: one decode step over a paged cache, 32 sequences of 8,192 tokens, 32 query heads over
// 8 KV heads of 128, pages of 16 tokens drawn from the pool in a random order per launch (a cache
// after some traffic). Every cached element is drawn on its own, so a sequence's keys can be
// recomputed from the page table alone; two (sequence, query head) rows checked per launch, with
// module 19's tolerance.
constexpr int kDecBatch = 32, kDecLen = 8192, kDecQHeads = 32, kDecKvHeads = 8, kDecDim = 128, kDecPage = 16;

Spec decode_attention() {
  constexpr int pages_per_seq = kDecLen / kDecPage, pool_pages = kDecBatch * pages_per_seq + 3;
  constexpr std::int64_t pool = static_cast<std::int64_t>(pool_pages) * kDecKvHeads * kDecPage * kDecDim,
                         nq = static_cast<std::int64_t>(kDecBatch) * kDecQHeads * kDecDim;
  Spec s;
  s.name = "decode_attention";
  s.shape = {kDecBatch, kDecQHeads, kDecKvHeads, kDecDim, kDecPage, pages_per_seq, kDecLen};
  // q, k_pool, v_pool, page_table, lengths; o
  s.buffers = {{nq * sizeof(bf16), false},
               {pool * sizeof(bf16), false},
               {pool * sizeof(bf16), false},
               {static_cast<std::size_t>(kDecBatch) * pages_per_seq * sizeof(int), false},
               {kDecBatch * sizeof(int), false},
               {nq * sizeof(bf16), true}};
  s.work = 2.0 * kDecBatch * static_cast<double>(kDecLen) * kDecKvHeads * kDecDim * sizeof(bf16);
  s.unit = "GB/s";
  // The page table is kept here for the check: the copy in the shared buffers is the test
  // program's to overwrite.
  auto kept = std::make_shared<Kept<std::vector<int>>>();
  s.fill = [kept](const std::vector<char*>& p, std::uint64_t seed) {
    fill_uniform_device(reinterpret_cast<bf16*>(p[0]), nq, buffer_seed(seed, 0), -3.0f, 3.0f);  // peaked softmaxes too
    fill_uniform_device(reinterpret_cast<bf16*>(p[1]), pool, buffer_seed(seed, 1));
    fill_uniform_device(reinterpret_cast<bf16*>(p[2]), pool, buffer_seed(seed, 2));
    std::vector<int> order(pool_pages);
    for (int i = 0; i < pool_pages; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), std::mt19937_64(buffer_seed(seed, 3)));
    std::vector<int> table(order.begin(), order.begin() + kDecBatch * pages_per_seq);
    const std::vector<int> lengths(kDecBatch, kDecLen);
    if (cudaMemcpy(p[3], table.data(), table.size() * sizeof(int), cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(p[4], lengths.data(), lengths.size() * sizeof(int), cudaMemcpyHostToDevice) != cudaSuccess)
      throw std::runtime_error("cannot upload the page table");
    kept->put(seed, std::move(table));
  };
  s.sample = [](std::mt19937_64& rng) {
    std::vector<Range> r;
    for (int t = 0; t < 2; ++t) r.push_back({5, (rng() % (kDecBatch * kDecQHeads)) * kDecDim * sizeof(bf16), kDecDim * sizeof(bf16)});
    return r;
  };
  s.check = [kept](std::uint64_t seed, const std::vector<Range>& ranges, const std::vector<const char*>& bytes) {
    const std::vector<int>& table = kept->at(seed);
    for (std::size_t t = 0; t < ranges.size(); ++t) {
      const std::int64_t row = static_cast<std::int64_t>(ranges[t].offset / (kDecDim * sizeof(bf16)));
      const std::int64_t b = row / kDecQHeads, h = row % kDecQHeads, g = h / (kDecQHeads / kDecKvHeads);
      std::vector<float> q(kDecDim), k(static_cast<std::size_t>(kDecLen) * kDecDim), v(k.size());
      for (int d = 0; d < kDecDim; ++d) q[d] = bf16_at(buffer_seed(seed, 0), row * kDecDim + d, -3.0f, 3.0f);
      for (std::int64_t tok = 0; tok < kDecLen; ++tok) {
        const std::int64_t page = table[b * pages_per_seq + tok / kDecPage];
        const std::int64_t from = ((page * kDecKvHeads + g) * kDecPage + tok % kDecPage) * kDecDim;
        for (int d = 0; d < kDecDim; ++d) {
          k[tok * kDecDim + d] = bf16_at(buffer_seed(seed, 1), from + d, -1.0f, 1.0f);
          v[tok * kDecDim + d] = bf16_at(buffer_seed(seed, 2), from + d, -1.0f, 1.0f);
        }
      }
      const std::vector<double> want =
          ref::attention_forward(q, k, v, {1, 1, 1, 1, kDecLen, kDecDim, false, 1.0 / std::sqrt(double(kDecDim))}).o;
      double top = 0;
      for (double w : want) top = std::max(top, std::fabs(w));
      for (int d = 0; d < kDecDim; ++d) {
        const double got = read_bf16(bytes[t] + d * sizeof(bf16));
        if (!(std::fabs(got - want[d]) <= 1e-2 * top + 1e-2 * std::fabs(want[d])))
          return "sequence " + std::to_string(b) + ", query head " + std::to_string(h) + ", value " + std::to_string(d) +
                 " = " + std::to_string(got) + ", expected " + std::to_string(want[d]);
      }
    }
    return std::string();
  };
  return s;
}

const std::vector<Spec>& all() {
  static const std::vector<Spec> specs = {copy(),          fma(),          sgemm_4096(),
                                          bf16_gemm("bf16_gemm"), bf16_gemm("bf16_gemm_hopper"), softmax_fast(),
                                          rmsnorm_forward(), rmsnorm_backward(), rope(true), rope(false),
                                          attention_forward("attention_forward"),
                                          attention_forward("attention_forward_hopper"), moe_up_projection(),
                                          decode_attention()};
  return specs;
}

}  // namespace

const Spec* find(const std::string& name) {
  for (const Spec& s : all())
    if (s.name == name) return &s;
  return nullptr;
}

}  // namespace k2c::witness_specs
