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

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include "k2c/core/check.h"
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
// shared buffers is the test program's to overwrite. The last `capacity` launches' are kept (by
// default 64, twice the most sets a window has), so a check always finds the launches of its own
// window.
template <class T>
class Kept {
 public:
  explicit Kept(std::size_t capacity = 64) : capacity_(capacity) {}
  void put(std::uint64_t seed, T value) {
    if (order_.size() == capacity_) {
      values_.erase(order_.front());
      order_.pop_front();
    }
    order_.push_back(seed);
    values_[seed] = std::move(value);
  }
  const T& at(std::uint64_t seed) const { return values_.at(seed); }

 private:
  std::size_t capacity_;
  std::map<std::uint64_t, T> values_;
  std::deque<std::uint64_t> order_;
};

// Draws from [lo, hi].
std::int64_t pick(std::mt19937_64& rng, std::int64_t lo, std::int64_t hi) {
  return lo + static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(hi - lo + 1));
}

// A piece of output that is one range of `bytes` bytes at index i of buffer `buffer`.
std::function<std::vector<Range>(std::int64_t)> pieces_of(std::uint32_t buffer, std::uint64_t bytes) {
  return [buffer, bytes](std::int64_t i) { return std::vector<Range>{{buffer, static_cast<std::uint64_t>(i) * bytes, bytes}}; };
}

// Σ a(i)·b(i) over i < k in double, and Σ |a(i)·b(i)|, the scale of its rounding error.
template <class A, class B>
std::pair<double, double> dot(std::int64_t k, A a, B b) {
  double sum = 0, magnitude = 0;
  for (std::int64_t i = 0; i < k; ++i) {
    const double p = static_cast<double>(a(i)) * b(i);
    sum += p;
    magnitude += std::fabs(p);
  }
  return {sum, magnitude};
}

// Module 00: a copy of n floats (timed: 1 GiB), checked bit for bit in runs of 4,096 elements.
Spec copy(const Shape& shape) {
  const std::int64_t n = shape.at(0);
  constexpr std::int64_t run = 4096;
  Spec s;
  s.name = "copy";
  s.shape = shape;
  s.buffers = {{n * sizeof(float), false}, {n * sizeof(float), true}};
  s.work = 2.0 * n * sizeof(float);
  s.unit = "GB/s";
  s.fill = [n](const std::vector<char*>& p, std::uint64_t seed) {
    fill_uniform_device(reinterpret_cast<float*>(p[0]), n, buffer_seed(seed, 0));
  };
  s.pieces = (n + run - 1) / run;
  s.piece = [n, run](std::int64_t i) {
    return std::vector<Range>{{1, static_cast<std::uint64_t>(i * run) * sizeof(float),
                               static_cast<std::uint64_t>(std::min(run, n - i * run)) * sizeof(float)}};
  };
  s.sampled = 16;
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

// Module 06: softmax of rows × cols bf16 logits in [-8, 8) (timed: 16,384 × 4,096), whole rows
// checked.
Spec softmax_fast(const Shape& shape) {
  const std::int64_t rows = shape.at(0), cols = shape.at(1), n = rows * cols;
  Spec s;
  s.name = "softmax_fast";
  s.shape = shape;
  s.buffers = {{n * sizeof(bf16), false}, {n * sizeof(bf16), true}};
  s.work = 2.0 * n * sizeof(bf16);
  s.unit = "GB/s";
  s.fill = [n](const std::vector<char*>& p, std::uint64_t seed) {
    fill_uniform_device(reinterpret_cast<bf16*>(p[0]), n, buffer_seed(seed, 0), -8.0f, 8.0f);
  };
  s.pieces = rows;
  s.piece = pieces_of(1, cols * sizeof(bf16));
  s.sampled = 4;
  s.check = [cols](std::uint64_t seed, const std::vector<Range>& ranges, const std::vector<const char*>& bytes) {
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

// Module 05: C = A·Bᵀ (A m×k, B n×k) in bf16 with fp32 accumulation (timed: 8192³). An element's
// error is its bf16 rounding (2⁻⁸ of its size) plus fp32 rounding over k products, far below the
// error of a wrong or missing element (the size of the element itself).
Spec bf16_gemm(const std::string& name, const Shape& shape) {
  const std::int64_t m = shape.at(0), n = shape.at(1), k = shape.at(2);
  Spec s;
  s.name = name;
  s.shape = shape;
  s.buffers = {{m * k * sizeof(bf16), false}, {n * k * sizeof(bf16), false}, {m * n * sizeof(bf16), true}};
  s.work = 2.0 * m * n * k;
  s.unit = "TFLOP/s";
  s.unit_scale = 1e12;
  s.fill = [m, n, k](const std::vector<char*>& p, std::uint64_t seed) {
    fill_uniform_device(reinterpret_cast<bf16*>(p[0]), m * k, buffer_seed(seed, 0));
    fill_uniform_device(reinterpret_cast<bf16*>(p[1]), n * k, buffer_seed(seed, 1));
  };
  s.pieces = m * n;
  s.piece = pieces_of(2, sizeof(bf16));
  s.sampled = 32;
  s.check = [n, k](std::uint64_t seed, const std::vector<Range>& ranges, const std::vector<const char*>& bytes) {
    for (std::size_t t = 0; t < ranges.size(); ++t) {
      const std::int64_t at = static_cast<std::int64_t>(ranges[t].offset / sizeof(bf16)), r = at / n, c = at % n;
      const auto [want, magnitude] =
          dot(k, [&](std::int64_t i) { return bf16_at(buffer_seed(seed, 0), r * k + i, -1.0f, 1.0f); },
              [&](std::int64_t i) { return bf16_at(buffer_seed(seed, 1), c * k + i, -1.0f, 1.0f); });
      const double got = read_bf16(bytes[t]);
      if (!(std::fabs(got - want) <= 0x1p-7 * std::fabs(want) + 2e-4 * magnitude))
        return "C[" + std::to_string(r) + "][" + std::to_string(c) + "] = " + std::to_string(got) + ", expected " +
               std::to_string(want);
    }
    return std::string();
  };
  return s;
}

// Module 00: the FMA chains of roofline.h (kFmaChains = 8 chains per element starting at
// x + j/8, each x = fma(x, 0.999, 0.001) `iters` times, then summed), in place on n elements
// (timed: two waves of threads of this GPU, 4,096 steps); elements replayed on the CPU.
Spec fma(const Shape& shape) {
  constexpr int chains = 8;
  constexpr float step = 0.125f, mul = 0.999f, add = 0.001f;
  const std::int64_t n = shape.at(0);
  const int iters = static_cast<int>(shape.at(1));
  Spec s;
  s.name = "fma";
  s.shape = shape;
  s.buffers = {{n * sizeof(float), false}};  // updated in place: filled, never poisoned
  s.work = 2.0 * chains * iters * static_cast<double>(n);
  s.unit = "TFLOP/s";
  s.unit_scale = 1e12;
  s.fill = [n](const std::vector<char*>& p, std::uint64_t seed) {
    fill_uniform_device(reinterpret_cast<float*>(p[0]), n, buffer_seed(seed, 0));
  };
  s.pieces = n;
  s.piece = pieces_of(0, sizeof(float));
  s.sampled = 32;
  s.check = [iters](std::uint64_t seed, const std::vector<Range>& ranges, const std::vector<const char*>& bytes) {
    for (std::size_t k = 0; k < ranges.size(); ++k) {
      const std::uint64_t i = ranges[k].offset / sizeof(float);
      const float start = uniform_at(buffer_seed(seed, 0), i, -1.0f, 1.0f);
      const double want = ref::fma_chains(std::span<const float>(&start, 1), iters, chains, step, mul, add)[0];
      float got;
      std::memcpy(&got, bytes[k], sizeof got);
      // The elementwise bound of module 00's test (kFp32Tolerance).
      if (!(std::fabs(got - want) <= 1e-5 * std::fabs(want) + 1e-5))
        return "out[" + std::to_string(i) + "] = " + std::to_string(got) + ", expected " + std::to_string(want);
    }
    return std::string();
  };
  return s;
}

// Modules 01–04: C = A·B in fp32 (A m×k, B k×n, row-major, alpha 1 and beta 0; timed: 4096³).
// Rounding over k products stays far below 4e-5 of the sum of their sizes, and a wrong element is
// off by about the size of the element.
Spec sgemm(const Shape& shape) {
  const std::int64_t m = shape.at(0), n = shape.at(1), k = shape.at(2);
  Spec s;
  s.name = "sgemm";
  s.shape = shape;
  s.buffers = {{m * k * sizeof(float), false}, {k * n * sizeof(float), false}, {m * n * sizeof(float), true}};
  s.work = 2.0 * m * n * k;
  s.unit = "TFLOP/s";
  s.unit_scale = 1e12;
  s.max_sets = 8;  // the naive kernel takes about 0.1 s a launch at 4096³
  s.fill = [m, n, k](const std::vector<char*>& p, std::uint64_t seed) {
    fill_uniform_device(reinterpret_cast<float*>(p[0]), m * k, buffer_seed(seed, 0));
    fill_uniform_device(reinterpret_cast<float*>(p[1]), k * n, buffer_seed(seed, 1));
  };
  s.pieces = m * n;
  s.piece = pieces_of(2, sizeof(float));
  s.sampled = 32;
  s.check = [n, k](std::uint64_t seed, const std::vector<Range>& ranges, const std::vector<const char*>& bytes) {
    for (std::size_t t = 0; t < ranges.size(); ++t) {
      const std::int64_t at = static_cast<std::int64_t>(ranges[t].offset / sizeof(float)), r = at / n, c = at % n;
      const auto [want, magnitude] =
          dot(k, [&](std::int64_t i) { return uniform_at(buffer_seed(seed, 0), r * k + i, -1.0f, 1.0f); },
              [&](std::int64_t i) { return uniform_at(buffer_seed(seed, 1), i * n + c, -1.0f, 1.0f); });
      float got;
      std::memcpy(&got, bytes[t], sizeof got);
      if (!(std::fabs(got - want) <= 4e-5 * magnitude + 1e-30))
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

// Module 07: RMSNorm of rows × cols (eps 1e-5, no residual; timed: 16,384 × 4,096), with the
// tolerances of the module's tests.
constexpr double kNormEps = 1e-5;
constexpr Tolerance kNormOut{1e-4, 4.5e-3, 4e-3}, kNormRstd{0, 2e-5, 1e-5};

std::vector<float> norm_row(std::uint64_t seed, int buffer, std::int64_t row, std::int64_t cols, float lo, float hi) {
  std::vector<float> x(cols);
  for (std::int64_t j = 0; j < cols; ++j) x[j] = bf16_at(buffer_seed(seed, buffer), row * cols + j, lo, hi);
  return x;
}

std::vector<float> norm_gamma(std::uint64_t seed, std::int64_t cols) { return norm_row(seed, 1, 0, cols, 0.5f, 1.5f); }

Spec rmsnorm_forward(const Shape& shape) {
  const std::int64_t rows = shape.at(0), cols = shape.at(1), n = rows * cols;
  Spec s;
  s.name = "rmsnorm_forward";
  s.shape = shape;
  // h, gamma; y, rstd
  s.buffers = {{n * sizeof(bf16), false}, {cols * sizeof(bf16), false}, {n * sizeof(bf16), true},
               {rows * sizeof(float), true}};
  s.work = 2.0 * n * sizeof(bf16);
  s.unit = "GB/s";
  s.fill = [n, cols](const std::vector<char*>& p, std::uint64_t seed) {
    fill_uniform_device(reinterpret_cast<bf16*>(p[0]), n, buffer_seed(seed, 0), -2.0f, 2.0f);
    fill_uniform_device(reinterpret_cast<bf16*>(p[1]), cols, buffer_seed(seed, 1), 0.5f, 1.5f);
  };
  s.pieces = rows;  // a row of y and its rstd
  s.piece = [cols](std::int64_t row) {
    const std::uint64_t r = static_cast<std::uint64_t>(row);
    return std::vector<Range>{{2, r * cols * sizeof(bf16), cols * sizeof(bf16)}, {3, r * sizeof(float), sizeof(float)}};
  };
  s.sampled = 4;
  s.check = [cols](std::uint64_t seed, const std::vector<Range>& ranges, const std::vector<const char*>& bytes) {
    const std::vector<float> gamma = norm_gamma(seed, cols);
    for (std::size_t k = 0; k + 1 < ranges.size(); k += 2) {
      const std::int64_t row = static_cast<std::int64_t>(ranges[k + 1].offset / sizeof(float));
      const ref::RmsNormForward want = ref::rmsnorm_forward(norm_row(seed, 0, row, cols, -2.0f, 2.0f), gamma, 1, cols, kNormEps);
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

Spec rmsnorm_backward(const Shape& shape) {
  const std::int64_t rows = shape.at(0), cols = shape.at(1), n = rows * cols;
  Spec s;
  s.name = "rmsnorm_backward";
  s.shape = shape;
  // h, gamma, dy, rstd; dx, dgamma
  s.buffers = {{n * sizeof(bf16), false},    {cols * sizeof(bf16), false}, {n * sizeof(bf16), false},
               {rows * sizeof(float), false}, {n * sizeof(bf16), true},     {cols * sizeof(float), true}};
  s.work = 3.0 * n * sizeof(bf16);
  s.unit = "GB/s";
  // rstd is computed from h here, and kept on the host for the check: the copy in the shared
  // buffers is the test program's to overwrite.
  auto kept = std::make_shared<Kept<std::vector<float>>>();
  s.fill = [kept, rows, cols, n](const std::vector<char*>& p, std::uint64_t seed) {
    fill_uniform_device(reinterpret_cast<bf16*>(p[0]), n, buffer_seed(seed, 0), -2.0f, 2.0f);
    fill_uniform_device(reinterpret_cast<bf16*>(p[1]), cols, buffer_seed(seed, 1), 0.5f, 1.5f);
    fill_uniform_device(reinterpret_cast<bf16*>(p[2]), n, buffer_seed(seed, 2), -1.0f, 1.0f);
    float* rstd = nullptr;
    if (cudaMalloc(&rstd, rows * sizeof(float)) != cudaSuccess) throw std::runtime_error("cudaMalloc of rstd failed");
    row_rstd<<<static_cast<unsigned>(rows), 256>>>(reinterpret_cast<const bf16*>(p[0]), rstd, static_cast<int>(cols), kNormEps);
    std::vector<float> host(rows);
    const cudaError_t e = cudaMemcpy(host.data(), rstd, rows * sizeof(float), cudaMemcpyDeviceToHost);
    cudaMemcpy(p[3], rstd, rows * sizeof(float), cudaMemcpyDeviceToDevice);
    cudaFree(rstd);
    if (e != cudaSuccess) throw std::runtime_error(std::string("rstd: ") + cudaGetErrorString(e));
    kept->put(seed, std::move(host));
  };
  s.pieces = rows + cols;  // the rows of dx, then the elements of dgamma
  s.piece = [rows, cols](std::int64_t i) {
    if (i < rows) return std::vector<Range>{{4, static_cast<std::uint64_t>(i * cols) * sizeof(bf16), cols * sizeof(bf16)}};
    return std::vector<Range>{{5, static_cast<std::uint64_t>(i - rows) * sizeof(float), sizeof(float)}};
  };
  s.sampled = 8;
  s.check = [kept, rows, cols](std::uint64_t seed, const std::vector<Range>& ranges, const std::vector<const char*>& bytes) {
    const std::vector<float> gamma = norm_gamma(seed, cols);
    const std::vector<float>& rstd = kept->at(seed);
    for (std::size_t k = 0; k < ranges.size(); ++k) {
      if (ranges[k].buffer == 4) {
        const std::int64_t row = static_cast<std::int64_t>(ranges[k].offset / (cols * sizeof(bf16)));
        const ref::RmsNormBackward want = ref::rmsnorm_backward(norm_row(seed, 0, row, cols, -2.0f, 2.0f), gamma,
                                                                norm_row(seed, 2, row, cols, -1.0f, 1.0f), 1, cols, kNormEps);
        // With one column dx is zero up to eps-sized terms, pure rounding noise: as module 07's test
        // does, only the elementwise bound holds then.
        Tolerance dx_tolerance = kNormOut;
        if (cols == 1) dx_tolerance.max_rel_l2 = 1.0;
        if (std::string p = compare_row("dx row", row, bytes[k], want.dx, dx_tolerance); !p.empty()) return p;
        continue;
      }
      const std::int64_t col = static_cast<std::int64_t>(ranges[k].offset / sizeof(float));
      double want = 0;
      for (std::int64_t r = 0; r < rows; ++r)
        want += static_cast<double>(bf16_at(buffer_seed(seed, 2), r * cols + col, -1.0f, 1.0f)) *
                bf16_at(buffer_seed(seed, 0), r * cols + col, -2.0f, 2.0f) * rstd[r];
      float got;
      std::memcpy(&got, bytes[k], sizeof got);
      // The tolerance of module 07's tests for dgamma summed over this many rows.
      if (!(std::fabs(got - want) <= 1e-6 + 2.4e-7 * rows + 1e-5 * std::fabs(want)))
        return "dgamma[" + std::to_string(col) + "] = " + std::to_string(got) + ", expected " + std::to_string(want);
    }
    return std::string();
  };
  return s;
}

// Module 08: RoPE on q and k of batch × seq tokens, q_heads and k_heads heads of dim, half-split
// pairs, base 10,000, from position 0 (timed: 4 × 4,096 tokens, 32 and 8 heads of 128), with the
// table (`rope_cache`) or without (`rope_on_the_fly`); whole tokens of q and k checked.
constexpr double kRopeBase = 10000.0;

Spec rope(bool cache, const Shape& shape) {
  const std::int64_t batch = shape.at(0), seq = shape.at(1), q_heads = shape.at(2), k_heads = shape.at(3), dim = shape.at(4);
  const std::int64_t tokens = batch * seq, nq = tokens * q_heads * dim, nk = tokens * k_heads * dim, pairs = seq * dim / 2;
  Spec s;
  s.name = cache ? "rope_cache" : "rope_on_the_fly";
  s.shape = shape;
  // q, k; q_out, k_out; the cos/sin table
  s.buffers = {{nq * sizeof(bf16), false}, {nk * sizeof(bf16), false}, {nq * sizeof(bf16), true}, {nk * sizeof(bf16), true}};
  if (cache) s.buffers.push_back({pairs * 2 * sizeof(float), false});
  s.work = 2.0 * (nq + nk) * sizeof(bf16);
  s.unit = "GB/s";
  // As build_cache's contract has it: angles in double, stored as fp32.
  auto table = std::make_shared<std::vector<float>>();
  if (cache) {
    table->resize(pairs * 2);
    for (std::int64_t pos = 0; pos < seq; ++pos)
      for (std::int64_t i = 0; i < dim / 2; ++i) {
        const double angle = pos * std::pow(kRopeBase, -2.0 * i / dim);
        (*table)[2 * (pos * dim / 2 + i)] = static_cast<float>(std::cos(angle));
        (*table)[2 * (pos * dim / 2 + i) + 1] = static_cast<float>(std::sin(angle));
      }
  }
  s.fill = [cache, nq, nk, table](const std::vector<char*>& p, std::uint64_t seed) {
    fill_uniform_device(reinterpret_cast<bf16*>(p[0]), nq, buffer_seed(seed, 0));
    fill_uniform_device(reinterpret_cast<bf16*>(p[1]), nk, buffer_seed(seed, 1));
    if (cache && cudaMemcpy(p[4], table->data(), table->size() * sizeof(float), cudaMemcpyHostToDevice) != cudaSuccess)
      throw std::runtime_error("cannot upload the cos/sin table");
  };
  s.pieces = tokens;  // a token's q and k
  s.piece = [q_heads, k_heads, dim](std::int64_t token) {
    const std::uint64_t t = static_cast<std::uint64_t>(token);
    return std::vector<Range>{{2, t * q_heads * dim * sizeof(bf16), q_heads * dim * sizeof(bf16)},
                              {3, t * k_heads * dim * sizeof(bf16), k_heads * dim * sizeof(bf16)}};
  };
  s.sampled = 4;
  s.check = [seq, q_heads, k_heads, dim](std::uint64_t seed, const std::vector<Range>& ranges,
                                         const std::vector<const char*>& bytes) {
    for (std::size_t k = 0; k < ranges.size(); ++k) {
      const bool is_q = ranges[k].buffer == 2;
      const std::int64_t heads = is_q ? q_heads : k_heads, len = heads * dim;
      const std::int64_t token = static_cast<std::int64_t>(ranges[k].offset / (len * sizeof(bf16)));
      std::vector<float> in(len);
      for (std::int64_t j = 0; j < len; ++j) in[j] = bf16_at(buffer_seed(seed, is_q ? 0 : 1), token * len + j, -1.0f, 1.0f);
      const std::vector<double> want = ref::rope(in, 1, static_cast<int>(heads), static_cast<int>(dim), token % seq,
                                                 kRopeBase, ref::RopeLayout::half_split, false);
      // The tolerance of module 08's tests.
      if (std::string p = compare_row(is_q ? "q of token" : "k of token", token, bytes[k], want, {1e-3, 4.5e-3, 4e-3});
          !p.empty())
        return p;
    }
    return std::string();
  };
  return s;
}

// Module 09: attention forward (shape: batch, heads, kv heads, q_len, kv_len, head_dim, causal;
// timed: B 4, 32 heads, 4,096 tokens, d 128, causal), inputs as the module's tests draw them; a
// piece is one query row of o and its lse, checked against the reference over exactly the keys it
// sees (the bottom-right causal mask of the module's contract), within the tests' bounds.
Spec attention_forward(const std::string& name, const Shape& shape) {
  const std::int64_t batch = shape.at(0), heads = shape.at(1), kv_heads = shape.at(2), q_len = shape.at(3),
                     kv_len = shape.at(4), d = shape.at(5);
  const bool causal = shape.at(6) != 0;
  const std::int64_t rows = batch * heads * q_len, nq = rows * d, nkv = batch * kv_heads * kv_len * d;
  const double scale = 1.0f / std::sqrt(static_cast<float>(d));  // as the tests' make_shape rounds it
  Spec s;
  s.name = name;
  s.shape = shape;
  // q, k, v; o, lse
  s.buffers = {{nq * sizeof(bf16), false}, {nkv * sizeof(bf16), false}, {nkv * sizeof(bf16), false},
               {nq * sizeof(bf16), true},  {rows * sizeof(float), true}};
  s.work = 4.0 * batch * heads * static_cast<double>(q_len) * kv_len * d * (causal ? 0.5 : 1.0);
  s.unit = "TFLOP/s";
  s.unit_scale = 1e12;
  s.max_sets = 16;
  s.fill = [nq, nkv](const std::vector<char*>& p, std::uint64_t seed) {
    fill_uniform_device(reinterpret_cast<bf16*>(p[0]), nq, buffer_seed(seed, 0), -2.0f, 2.0f);
    fill_uniform_device(reinterpret_cast<bf16*>(p[1]), nkv, buffer_seed(seed, 1), -2.0f, 2.0f);
    fill_uniform_device(reinterpret_cast<bf16*>(p[2]), nkv, buffer_seed(seed, 2), -1.0f, 1.0f);
  };
  s.pieces = rows;
  s.piece = [d](std::int64_t row) {
    const std::uint64_t r = static_cast<std::uint64_t>(row);
    return std::vector<Range>{{3, r * d * sizeof(bf16), d * sizeof(bf16)}, {4, r * sizeof(float), sizeof(float)}};
  };
  s.sampled = 2;
  s.check = [=](std::uint64_t seed, const std::vector<Range>& ranges, const std::vector<const char*>& bytes) {
    std::map<std::int64_t, std::pair<std::vector<float>, std::vector<float>>> kv;
    for (std::size_t t = 0; t + 1 < ranges.size(); t += 2) {
      const std::int64_t row = static_cast<std::int64_t>(ranges[t + 1].offset / sizeof(float));
      const std::int64_t i = row % q_len, bh = row / q_len, b = bh / heads, g = (bh % heads) / (heads / kv_heads);
      const std::int64_t seen = causal ? std::clamp<std::int64_t>(i + 1 + kv_len - q_len, 0, kv_len) : kv_len;
      float lse;
      std::memcpy(&lse, bytes[t + 1], sizeof lse);
      if (seen == 0) {  // output 0 and lse +inf, exactly
        for (std::int64_t c = 0; c < d; ++c)
          if (read_bf16(bytes[t] + c * sizeof(bf16)) != 0.0f)
            return "o[row " + std::to_string(row) + "][" + std::to_string(c) + "] of a query that sees no key is not 0";
        if (!(std::isinf(lse) && lse > 0)) return "lse[row " + std::to_string(row) + "] of a query that sees no key is not +inf";
        continue;
      }
      std::vector<float> q(d);
      for (std::int64_t c = 0; c < d; ++c) q[c] = bf16_at(buffer_seed(seed, 0), row * d + c, -2.0f, 2.0f);
      // The keys and values of this row's KV head, drawn once per check for all its rows.
      auto& [k, v] = kv[b * kv_heads + g];
      if (k.empty()) {
        const std::int64_t kv0 = (b * kv_heads + g) * kv_len * d;
        for (std::int64_t j = 0; j < kv_len * d; ++j) {
          k.push_back(bf16_at(buffer_seed(seed, 1), kv0 + j, -2.0f, 2.0f));
          v.push_back(bf16_at(buffer_seed(seed, 2), kv0 + j, -1.0f, 1.0f));
        }
      }
      const ref::AttentionForward want =
          ref::attention_forward(q, std::span<const float>(k.data(), seen * d), std::span<const float>(v.data(), seen * d),
                                 {1, 1, 1, 1, static_cast<int>(seen), static_cast<int>(d), false, scale});
      for (std::int64_t c = 0; c < d; ++c) {
        const double got = read_bf16(bytes[t] + c * sizeof(bf16));
        // The bound of module 09's tests: a bf16 rounding of every intermediate, with a margin.
        const double bound = 1.25 * std::ldexp(want.o_magnitude[c] + std::fabs(want.o[c]), -8) + 1e-5;
        if (!(std::fabs(got - want.o[c]) <= bound))
          return "o[row " + std::to_string(row) + "][" + std::to_string(c) + "] = " + std::to_string(got) + ", expected " +
                 std::to_string(want.o[c]);
      }
      if (!(std::isfinite(lse) && std::fabs(lse - want.lse[0]) <= 1e-4 + kv_len * 6e-8 + 1e-6 * std::fabs(want.lse[0])))
        return "lse[row " + std::to_string(row) + "] = " + std::to_string(lse) + ", expected " + std::to_string(want.lse[0]);
    }
    return std::string();
  };
  return s;
}

// The range the backward witness draws input buffer `b` from: q and k in [-2, 2], v and dout in
// [-1, 1], as module 09's tests draw them.
std::pair<float, float> attention_range(int b) { return b == 0 || b == 1 ? std::pair{-2.0f, 2.0f} : std::pair{-1.0f, 1.0f}; }

// Module 09's backward pass needs the o and lse of a forward pass over the same inputs: this
// checker makes them itself, with cuBLAS and a kernel of its own, one head at a time: S = Q·Kᵀ in
// fp32, each row's softmax under the mask (lse in fp32, P rounded to bf16 as a fused kernel rounds
// it), O = P·V rounded to bf16. For each query row it also keeps D = Σ dO ∘ O and e = Σ |dO ∘ O|
// (in double, from the bf16 O and dO the pass is given): with lse, all the CPU reference needs of
// the forward pass.
__global__ void masked_softmax_rows(const float* S, bf16* P, float* lse, int q_len, int kv_len, float scale, bool causal) {
  __shared__ float part[256];
  const int i = blockIdx.x;
  const float* s = S + static_cast<std::size_t>(i) * kv_len;
  bf16* p = P + static_cast<std::size_t>(i) * kv_len;
  const long last = causal ? static_cast<long>(i) + kv_len - q_len : kv_len - 1;  // the last key row i sees
  const int seen = static_cast<int>(last < 0 ? 0 : (last + 1 < kv_len ? last + 1 : kv_len));
  auto reduce = [&](float v, bool is_max) {
    part[threadIdx.x] = v;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w /= 2) {
      if (threadIdx.x < w) part[threadIdx.x] = is_max ? fmaxf(part[threadIdx.x], part[threadIdx.x + w]) : part[threadIdx.x] + part[threadIdx.x + w];
      __syncthreads();
    }
    const float r = part[0];
    __syncthreads();
    return r;
  };
  float m = -INFINITY;
  for (int j = threadIdx.x; j < seen; j += blockDim.x) m = fmaxf(m, s[j] * scale);
  m = reduce(m, true);
  float sum = 0;
  for (int j = threadIdx.x; j < seen; j += blockDim.x) sum += expf(s[j] * scale - m);
  sum = reduce(sum, false);
  const float l = seen > 0 ? m + logf(sum) : INFINITY;
  if (threadIdx.x == 0) lse[i] = l;
  for (int j = threadIdx.x; j < kv_len; j += blockDim.x) p[j] = __float2bfloat16(j < seen ? expf(s[j] * scale - l) : 0.0f);
}

__global__ void row_terms(const bf16* o, const bf16* dout, double* D, double* e, std::int64_t rows, int d) {
  const std::int64_t r = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  double sum = 0, magnitude = 0;
  for (int c = 0; c < d; ++c) {
    const double x = static_cast<double>(__bfloat162float(dout[r * d + c])) * __bfloat162float(o[r * d + c]);
    sum += x;
    magnitude += fabs(x);
  }
  D[r] = sum;
  e[r] = magnitude;
}

// o and lse of every head (heads first, GQA's group of query heads on one kv head) into the
// buffers, and the rows' lse, D and e on the host.
AttentionRows witness_forward(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, bf16* o, float* lse,
                            std::int64_t batch, std::int64_t heads, std::int64_t kv_heads, std::int64_t q_len,
                            std::int64_t kv_len, std::int64_t d, bool causal, float scale) {
  struct Blas {
    cublasHandle_t h{};
    Blas() { K2C_CUBLAS_CHECK(cublasCreate(&h)); }
    ~Blas() { cublasDestroy(h); }
  };
  static Blas blas;
  const std::int64_t rows = batch * heads * q_len, per_head = q_len * kv_len;
  float* S = nullptr;
  bf16* P = nullptr;
  double* terms = nullptr;
  AttentionRows out{std::vector<float>(rows), std::vector<double>(rows), std::vector<double>(rows)};
  try {
    K2C_CUDA_CHECK(cudaMalloc(&S, per_head * sizeof(float)));
    K2C_CUDA_CHECK(cudaMalloc(&P, per_head * sizeof(bf16)));
    K2C_CUDA_CHECK(cudaMalloc(&terms, 2 * rows * sizeof(double)));
    const float one = 1.0f, zero = 0.0f;
    const int m = static_cast<int>(q_len), n = static_cast<int>(kv_len), dd = static_cast<int>(d);
    for (std::int64_t bh = 0; bh < batch * heads; ++bh) {
      const std::int64_t b = bh / heads, g = (bh % heads) / (heads / kv_heads);
      const bf16* qh = q + bh * q_len * d;
      const bf16* kh = k + (b * kv_heads + g) * kv_len * d;
      const bf16* vh = v + (b * kv_heads + g) * kv_len * d;
      // Row-major S (q_len × kv_len) = Q·Kᵀ is column-major Sᵀ = K·Qᵀ: cuBLAS sees K (d × kv_len,
      // column-major) transposed and Q (d × q_len) as it is.
      K2C_CUBLAS_CHECK(cublasGemmEx(blas.h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, dd, &one, kh, CUDA_R_16BF, dd, qh, CUDA_R_16BF, dd,
                                    &zero, S, CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      masked_softmax_rows<<<m, 256>>>(S, P, lse + bh * q_len, m, n, scale, causal);
      K2C_CUDA_CHECK(cudaGetLastError());
      // Row-major O (q_len × d) = P·V is column-major Oᵀ = Vᵀ·Pᵀ: V (d × kv_len) and P (kv_len × q_len).
      K2C_CUBLAS_CHECK(cublasGemmEx(blas.h, CUBLAS_OP_N, CUBLAS_OP_N, dd, m, n, &one, vh, CUDA_R_16BF, dd, P, CUDA_R_16BF, n,
                                    &zero, o + bh * q_len * d, CUDA_R_16BF, dd, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
    row_terms<<<static_cast<unsigned>((rows + 255) / 256), 256>>>(o, dout, terms, terms + rows, rows, dd);
    K2C_CUDA_CHECK(cudaGetLastError());
    K2C_CUDA_CHECK(cudaMemcpy(out.lse.data(), lse, rows * sizeof(float), cudaMemcpyDeviceToHost));
    K2C_CUDA_CHECK(cudaMemcpy(out.D.data(), terms, rows * sizeof(double), cudaMemcpyDeviceToHost));
    K2C_CUDA_CHECK(cudaMemcpy(out.e.data(), terms + rows, rows * sizeof(double), cudaMemcpyDeviceToHost));
  } catch (...) {
    cudaFree(S), cudaFree(P), cudaFree(terms);
    throw;
  }
  cudaFree(S), cudaFree(P), cudaFree(terms);
  return out;
}

// Module 09: the backward pass at attention_forward's shapes, on o and lse this checker computed
// (witness_forward); pieces are rows of dq, and rows of dk with the same rows of dv, each checked
// against the CPU reference given the same lse and each row's D and e, with the bound of module
// 09's tests.
Spec attention_backward(const std::string& name, const Shape& shape) {
  const std::int64_t batch = shape.at(0), heads = shape.at(1), kv_heads = shape.at(2), q_len = shape.at(3),
                     kv_len = shape.at(4), d = shape.at(5);
  const bool causal = shape.at(6) != 0;
  const std::int64_t q_rows = batch * heads * q_len, kv_rows = batch * kv_heads * kv_len, nq = q_rows * d, nkv = kv_rows * d;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));  // as the tests' make_shape rounds it
  Spec s;
  s.name = name;
  s.shape = shape;
  // q, k, v, o, dout, lse; dq, dk, dv
  s.buffers = {{nq * sizeof(bf16), false},     {nkv * sizeof(bf16), false}, {nkv * sizeof(bf16), false},
               {nq * sizeof(bf16), false},     {nq * sizeof(bf16), false},  {q_rows * sizeof(float), false},
               {nq * sizeof(bf16), true},      {nkv * sizeof(bf16), true},  {nkv * sizeof(bf16), true}};
  s.work = 2.5 * 4.0 * batch * heads * static_cast<double>(q_len) * kv_len * d * (causal ? 0.5 : 1.0);
  s.unit = "TFLOP/s";
  s.unit_scale = 1e12;
  s.max_sets = 8;
  // Two windows' worth: about 10 MiB a launch at the timed shape.
  auto kept = std::make_shared<Kept<AttentionRows>>(2 * s.max_sets);
  s.fill = [=](const std::vector<char*>& p, std::uint64_t seed) {
    auto b = [&](int i) { return reinterpret_cast<bf16*>(p[i]); };
    for (const int input : {0, 1, 2, 4}) {  // q, k, v, dout: what attention_input draws
      const auto [lo, hi] = attention_range(input);
      fill_uniform_device(b(input), input == 1 || input == 2 ? nkv : nq, buffer_seed(seed, input), lo, hi);
    }
    kept->put(seed, witness_forward(b(0), b(1), b(2), b(4), b(3), reinterpret_cast<float*>(p[5]), batch, heads, kv_heads,
                                    q_len, kv_len, d, causal, scale));
  };
  s.pieces = q_rows + kv_rows;
  s.piece = [=](std::int64_t i) {
    const std::uint64_t bytes = d * sizeof(bf16);
    if (i < q_rows) return std::vector<Range>{{6, static_cast<std::uint64_t>(i) * bytes, bytes}};
    const std::uint64_t at = static_cast<std::uint64_t>(i - q_rows) * bytes;
    return std::vector<Range>{{7, at, bytes}, {8, at, bytes}};
  };
  s.sampled = 2;
  s.check = [shape, kept](std::uint64_t seed, const std::vector<Range>& ranges, const std::vector<const char*>& bytes) {
    return check_attention_backward(shape, seed, kept->at(seed), ranges, bytes);
  };
  return s;
}

// Module 10: the routed experts' up projection, [g|u] = x·W13ᵀ per expert (shape: experts, rows,
// n, k, top_k; timed: 16,384 tokens each to 6 of 64 experts picked uniformly, n = 2 × 1,408,
// k = 2,048), loads drawn afresh for every launch; elements of C checked.
Spec moe_up_projection(const Shape& shape) {
  const std::int64_t experts = shape.at(0), rows = shape.at(1), n = shape.at(2), k = shape.at(3), top_k = shape.at(4);
  Spec s;
  s.name = "moe_up_projection";
  s.shape = shape;
  // a, b (every expert's weight), offsets; c
  s.buffers = {{rows * k * sizeof(bf16), false},
               {static_cast<std::size_t>(experts * n * k) * sizeof(bf16), false},
               {(experts + 1) * sizeof(int), false},
               {rows * n * sizeof(bf16), true}};
  s.work = 2.0 * rows * static_cast<double>(n) * k;
  s.unit = "TFLOP/s";
  s.unit_scale = 1e12;
  s.max_sets = 8;
  // The offsets are kept here for the check: the copy in the shared buffers is the test
  // program's to overwrite.
  auto kept = std::make_shared<Kept<std::vector<int>>>();
  s.fill = [=](const std::vector<char*>& p, std::uint64_t seed) {
    fill_uniform_device(reinterpret_cast<bf16*>(p[0]), rows * k, buffer_seed(seed, 0));
    fill_uniform_device(reinterpret_cast<bf16*>(p[1]), experts * n * k, buffer_seed(seed, 1));
    const std::vector<int> counts = baseline::expert_loads(static_cast<int>(rows / top_k), static_cast<int>(experts),
                                                           static_cast<int>(top_k), false, buffer_seed(seed, 2));
    std::vector<int> offsets(experts + 1, 0);
    for (std::int64_t e = 0; e < experts; ++e) offsets[e + 1] = offsets[e] + counts[e];
    if (offsets.back() != rows) throw std::runtime_error("expert_loads: rows do not add up");
    if (cudaMemcpy(p[2], offsets.data(), offsets.size() * sizeof(int), cudaMemcpyHostToDevice) != cudaSuccess)
      throw std::runtime_error("cannot upload the offsets");
    kept->put(seed, offsets);
  };
  s.pieces = rows * n;
  s.piece = pieces_of(3, sizeof(bf16));
  s.sampled = 32;
  s.check = [kept, n, k](std::uint64_t seed, const std::vector<Range>& ranges, const std::vector<const char*>& bytes) {
    const std::vector<int>& offsets = kept->at(seed);
    for (std::size_t t = 0; t < ranges.size(); ++t) {
      const std::int64_t at = static_cast<std::int64_t>(ranges[t].offset / sizeof(bf16)), r = at / n, c = at % n;
      const std::int64_t e = std::upper_bound(offsets.begin(), offsets.end(), static_cast<int>(r)) - offsets.begin() - 1;
      const auto [want, magnitude] =
          dot(k, [&](std::int64_t i) { return bf16_at(buffer_seed(seed, 0), r * k + i, -1.0f, 1.0f); },
              [&](std::int64_t i) { return bf16_at(buffer_seed(seed, 1), (e * n + c) * k + i, -1.0f, 1.0f); });
      const double got = read_bf16(bytes[t]);
      if (!(std::fabs(got - want) <= 0x1p-7 * std::fabs(want) + 2e-4 * magnitude))
        return "C[" + std::to_string(r) + "][" + std::to_string(c) + "] (expert " + std::to_string(e) +
               ") = " + std::to_string(got) + ", expected " + std::to_string(want);
    }
    return std::string();
  };
  return s;
}

// Module 19: one decode step over a paged cache (shape: batch, query heads, KV heads, head_dim,
// page size, pages per sequence, longest length, and 1 to draw each sequence's length below it;
// timed: 32 sequences of 8,192 tokens, 32 query heads over 8 KV heads of 128, pages of 16), pages
// drawn from the pool in a random order per launch (a cache after some traffic). Every cached
// element is drawn on its own, so a sequence's keys can be recomputed from the page table alone;
// a piece is one (sequence, query head) row of o, checked with module 19's tolerance.
Spec decode_attention(const Shape& shape) {
  const std::int64_t batch = shape.at(0), q_heads = shape.at(1), kv_heads = shape.at(2), d = shape.at(3),
                     page = shape.at(4), pages_per_seq = shape.at(5), max_len = shape.at(6);
  const bool varied = shape.size() > 7 && shape[7] != 0;
  const std::int64_t pool_pages = batch * pages_per_seq + 3, pool = pool_pages * kv_heads * page * d,
                     nq = batch * q_heads * d;
  Spec s;
  s.name = "decode_attention";
  s.shape = shape;
  // q, k_pool, v_pool, page_table, lengths; o
  s.buffers = {{nq * sizeof(bf16), false},
               {pool * sizeof(bf16), false},
               {pool * sizeof(bf16), false},
               {static_cast<std::size_t>(batch * pages_per_seq) * sizeof(int), false},
               {batch * sizeof(int), false},
               {nq * sizeof(bf16), true}};
  s.work = 2.0 * batch * static_cast<double>(max_len) * kv_heads * d * sizeof(bf16);
  s.unit = "GB/s";
  // The page table and the lengths are kept here for the check: the copies in the shared buffers
  // are the test program's to overwrite.
  struct Cache {
    std::vector<int> table, lengths;
  };
  auto kept = std::make_shared<Kept<Cache>>();
  s.fill = [=](const std::vector<char*>& p, std::uint64_t seed) {
    fill_uniform_device(reinterpret_cast<bf16*>(p[0]), nq, buffer_seed(seed, 0), -3.0f, 3.0f);  // peaked softmaxes too
    fill_uniform_device(reinterpret_cast<bf16*>(p[1]), pool, buffer_seed(seed, 1));
    fill_uniform_device(reinterpret_cast<bf16*>(p[2]), pool, buffer_seed(seed, 2));
    std::vector<int> order(pool_pages);
    for (std::int64_t i = 0; i < pool_pages; ++i) order[i] = static_cast<int>(i);
    std::mt19937_64 rng(buffer_seed(seed, 3));
    std::shuffle(order.begin(), order.end(), rng);
    Cache c{std::vector<int>(order.begin(), order.begin() + batch * pages_per_seq), std::vector<int>(batch, static_cast<int>(max_len))};
    if (varied)
      for (int& len : c.lengths) len = static_cast<int>(pick(rng, 1, max_len));
    if (cudaMemcpy(p[3], c.table.data(), c.table.size() * sizeof(int), cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(p[4], c.lengths.data(), c.lengths.size() * sizeof(int), cudaMemcpyHostToDevice) != cudaSuccess)
      throw std::runtime_error("cannot upload the page table");
    kept->put(seed, std::move(c));
  };
  s.pieces = batch * q_heads;
  s.piece = pieces_of(5, d * sizeof(bf16));
  s.sampled = 2;
  s.check = [=](std::uint64_t seed, const std::vector<Range>& ranges, const std::vector<const char*>& bytes) {
    const Cache& c = kept->at(seed);
    for (std::size_t t = 0; t < ranges.size(); ++t) {
      const std::int64_t row = static_cast<std::int64_t>(ranges[t].offset / (d * sizeof(bf16)));
      const std::int64_t b = row / q_heads, h = row % q_heads, g = h / (q_heads / kv_heads), len = c.lengths[b];
      std::vector<float> q(d), k(len * d), v(len * d);
      for (std::int64_t i = 0; i < d; ++i) q[i] = bf16_at(buffer_seed(seed, 0), row * d + i, -3.0f, 3.0f);
      for (std::int64_t tok = 0; tok < len; ++tok) {
        const std::int64_t pg = c.table[b * pages_per_seq + tok / page];
        const std::int64_t from = ((pg * kv_heads + g) * page + tok % page) * d;
        for (std::int64_t i = 0; i < d; ++i) {
          k[tok * d + i] = bf16_at(buffer_seed(seed, 1), from + i, -1.0f, 1.0f);
          v[tok * d + i] = bf16_at(buffer_seed(seed, 2), from + i, -1.0f, 1.0f);
        }
      }
      const std::vector<double> want =
          ref::attention_forward(q, k, v, {1, 1, 1, 1, static_cast<int>(len), static_cast<int>(d), false, 1.0 / std::sqrt(double(d))}).o;
      double top = 0;
      for (double w : want) top = std::max(top, std::fabs(w));
      for (std::int64_t i = 0; i < d; ++i) {
        const double got = read_bf16(bytes[t] + i * sizeof(bf16));
        if (!(std::fabs(got - want[i]) <= 1e-2 * top + 1e-2 * std::fabs(want[i])))
          return "sequence " + std::to_string(b) + ", query head " + std::to_string(h) + ", value " + std::to_string(i) +
                 " = " + std::to_string(got) + ", expected " + std::to_string(want[i]);
      }
    }
    return std::string();
  };
  return s;
}

// Rows × cols as modules 06 and 07 draw them (k2c::testing::random_row_shapes): any width up to
// 20,000, about 200,000 elements at most.
Shape row_shape(std::mt19937_64& rng) {
  const std::int64_t cols = pick(rng, 1, 20000);
  return {pick(rng, 1, std::max<std::int64_t>(1, 200000 / cols)), cols};
}

// As module 09's random shapes: up to 300 tokens of queries and keys each, GQA groups up to 4,
// head_dim 64 or 128, causal or not.
Shape attention_shape(std::mt19937_64& rng) {
  const std::int64_t kv_heads = pick(rng, 1, 3);
  return Shape{pick(rng, 1, 2), kv_heads * pick(rng, 1, 4), kv_heads, pick(rng, 1, 300), pick(rng, 1, 300),
               pick(rng, 0, 1) ? 128 : 64, pick(rng, 0, 1)};
}

// M, N and K up to 300 each, K a multiple of 8 (module 05's fast path, and Part B's contract).
Shape gemm_shape(std::mt19937_64& rng, bool k_multiple_of_8) {
  std::int64_t k = pick(rng, 1, 300);
  if (k_multiple_of_8) k = (k + 7) / 8 * 8;
  return {pick(rng, 1, 300), pick(rng, 1, 300), k};
}

const std::vector<Witness>& known() {
  static const std::vector<Witness> witnesses = [] {
    const std::int64_t sms = device_info().sms;
    std::vector<Witness> w;
    w.push_back({"copy", {std::int64_t{1} << 28}, copy,
                 [](std::mt19937_64& rng) { return Shape{pick(rng, 1, pick(rng, 0, 1) ? 5000 : 3000000)}; }});
    w.push_back({"fma", {sms * 2048 * 2, 4096}, fma,
                 [](std::mt19937_64& rng) { return Shape{pick(rng, 1, 30000), pick(rng, 0, 256)}; }});
    w.push_back({"sgemm", {4096, 4096, 4096}, sgemm, [](std::mt19937_64& rng) { return gemm_shape(rng, false); }});
    for (const char* name : {"bf16_gemm", "bf16_gemm_hopper"})
      w.push_back({name, {8192, 8192, 8192}, [name](const Shape& s) { return bf16_gemm(name, s); },
                   [](std::mt19937_64& rng) { return gemm_shape(rng, true); }});
    w.push_back({"softmax_fast", {16384, 4096}, softmax_fast, row_shape});
    w.push_back({"rmsnorm_forward", {16384, 4096}, rmsnorm_forward, row_shape});
    w.push_back({"rmsnorm_backward", {16384, 4096}, rmsnorm_backward, row_shape});
    for (const bool cache : {true, false})
      w.push_back({cache ? "rope_cache" : "rope_on_the_fly", {4, 4096, 32, 8, 128},
                   [cache](const Shape& s) { return rope(cache, s); },
                   [](std::mt19937_64& rng) {  // as module 08's random cases, from position 0
                     static constexpr std::int64_t dims[] = {2, 4, 8, 16, 32, 64, 80, 128, 256};
                     const std::int64_t kv = pick(rng, 1, 4);
                     return Shape{pick(rng, 1, 3), pick(rng, 1, 300), kv * pick(rng, 1, 4), kv, dims[pick(rng, 0, 8)]};
                   }});
    for (const char* name : {"attention_forward", "attention_forward_hopper"})
      w.push_back({name, {4, 32, 32, 4096, 4096, 128, 1}, [name](const Shape& s) { return attention_forward(name, s); },
                   attention_shape});
    for (const char* name : {"attention_backward", "attention_backward_hopper"})
      w.push_back({name, {4, 32, 32, 4096, 4096, 128, 1}, [name](const Shape& s) { return attention_backward(name, s); },
                   attention_shape});
    w.push_back({"moe_up_projection", {64, 16384 * 6, 2 * 1408, 2048, 6}, moe_up_projection,
                 [](std::mt19937_64& rng) {  // empty experts included; k % 8 == 0 for Part B
                   const std::int64_t experts = pick(rng, 1, 16), top_k = pick(rng, 1, std::min<std::int64_t>(experts, 6));
                   return Shape{experts, pick(rng, 1, 60) * top_k, pick(rng, 1, 300), 8 * pick(rng, 1, 40), top_k};
                 }});
    w.push_back({"decode_attention", {32, 32, 8, 128, 16, 512, 8192}, decode_attention,
                 [](std::mt19937_64& rng) {  // module 19's contract: groups up to 8, any page size
                   const std::int64_t kv = pick(rng, 1, 4), page = pick(rng, 1, 64), longest = pick(rng, 1, 3000);
                   return Shape{pick(rng, 1, 4), kv * pick(rng, 1, 8), kv, pick(rng, 0, 1) ? 128 : 64,
                                page, (longest + page - 1) / page, longest, 1};
                 }});
    return w;
  }();
  return witnesses;
}

}  // namespace

float attention_input(std::uint64_t seed, int buffer, std::int64_t i) {
  const auto [lo, hi] = attention_range(buffer);
  return bf16_at(buffer_seed(seed, buffer), i, lo, hi);
}

std::string check_attention_backward(const Shape& shape, std::uint64_t seed, const AttentionRows& rows,
                                     const std::vector<Range>& ranges, const std::vector<const char*>& bytes) {
  const std::int64_t batch = shape.at(0), heads = shape.at(1), kv_heads = shape.at(2), q_len = shape.at(3),
                     kv_len = shape.at(4), d = shape.at(5);
  const bool causal = shape.at(6) != 0;
  const std::int64_t group = heads / kv_heads, q_rows = batch * heads * q_len;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));  // as the tests' make_shape rounds it
  if (rows.lse.size() != static_cast<std::size_t>(q_rows) || rows.D.size() != rows.lse.size() || rows.e.size() != rows.lse.size())
    throw std::invalid_argument("check_attention_backward: lse, D and e need one number per query row");
  // The inputs of one kv head and its group of query heads, drawn once per check, as a batch of
  // one with kv_heads 1 for the reference.
  struct Group {
    std::vector<float> q, k, v, dout, lse;
    std::vector<double> D, e;
  };
  std::map<std::int64_t, Group> groups;
  auto group_of = [&](std::int64_t b, std::int64_t g) -> const Group& {
    Group& x = groups[b * kv_heads + g];
    if (!x.q.empty()) return x;
    const std::int64_t q0 = (b * heads + g * group) * q_len, kv0 = (b * kv_heads + g) * kv_len;
    for (std::int64_t i = 0; i < group * q_len * d; ++i) {
      x.q.push_back(attention_input(seed, 0, q0 * d + i));
      x.dout.push_back(attention_input(seed, 4, q0 * d + i));
    }
    for (std::int64_t i = 0; i < kv_len * d; ++i) {
      x.k.push_back(attention_input(seed, 1, kv0 * d + i));
      x.v.push_back(attention_input(seed, 2, kv0 * d + i));
    }
    x.lse.assign(rows.lse.begin() + q0, rows.lse.begin() + q0 + group * q_len);
    x.D.assign(rows.D.begin() + q0, rows.D.begin() + q0 + group * q_len);
    x.e.assign(rows.e.begin() + q0, rows.e.begin() + q0 + group * q_len);
    return x;
  };
  const ref::AttentionShape one{1, static_cast<int>(group), 1, static_cast<int>(q_len), static_cast<int>(kv_len),
                                static_cast<int>(d), causal, scale};
  // Module 09's bound: a bf16 rounding of every intermediate, with a margin.
  auto compare = [&](const char* what, std::int64_t row, const char* got, const std::vector<double>& want,
                     const std::vector<double>& magnitude) {
    for (std::int64_t c = 0; c < d; ++c) {
      const double x = read_bf16(got + c * sizeof(bf16));
      const double bound = 1.25 * std::ldexp(magnitude[c] + std::fabs(want[c]), -8) + 1e-5;
      if (!(std::fabs(x - want[c]) <= bound))
        return std::string(what) + "[row " + std::to_string(row) + "][" + std::to_string(c) + "] = " + std::to_string(x) +
               ", expected " + std::to_string(want[c]);
    }
    return std::string();
  };
  for (std::size_t t = 0; t < ranges.size(); ++t) {
    const std::int64_t row = static_cast<std::int64_t>(ranges[t].offset / (d * sizeof(bf16)));
    if (ranges[t].buffer == 6) {  // dq of query row `row`
      const std::int64_t i = row % q_len, bh = row / q_len, b = bh / heads, h = bh % heads, g = h / group;
      const Group& x = group_of(b, g);
      const ref::AttentionRowGradient want = ref::attention_query_gradient_at(
          x.q, x.k, x.v, ref::AttentionRowTerms{x.D, x.e}, x.dout, x.lse, one, 0, static_cast<int>(h % group), static_cast<int>(i));
      if (std::string p = compare("dq", row, bytes[t], want.dq, want.dq_magnitude); !p.empty()) return p;
      continue;
    }
    if (ranges[t].buffer != 7 || t + 1 >= ranges.size() || ranges[t + 1].buffer != 8)
      return std::string("a piece of dk without its dv");
    const std::int64_t j = row % kv_len, bg = row / kv_len, b = bg / kv_heads, g = bg % kv_heads;
    const Group& x = group_of(b, g);
    const ref::AttentionRowGradient want =
        ref::attention_key_gradient_at(x.q, x.k, x.v, ref::AttentionRowTerms{x.D, x.e}, x.dout, x.lse, one, 0, 0, static_cast<int>(j));
    if (std::string p = compare("dk", row, bytes[t], want.dk, want.dk_magnitude); !p.empty()) return p;
    if (std::string p = compare("dv", row, bytes[t + 1], want.dv, want.dv_magnitude); !p.empty()) return p;
    ++t;
  }
  return std::string();
}

const std::vector<Witness>& all() { return known(); }

const Witness* find(const std::string& name) {
  for (const Witness& w : all())
    if (w.name == name) return &w;
  return nullptr;
}

}  // namespace k2c::witness_specs
