// k2c/testing/compare.h — comparing a kernel's output with a CPU reference.
//
// Two criteria, both required:
//   - every element within atol + rtol * |ref| (NaN or Inf in the output always fails), and
//   - the relative error norm ||out - ref|| / ||ref|| at most max_rel_l2.
// The elementwise test catches a single wrong or unwritten element (outputs are poisoned with
// NaN before each run); the norm catches small errors spread everywhere. The report keeps the
// first mismatches with their indices (as (row, col) when the caller gives a row length).
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace k2c {

struct Tolerance {
  double atol = 0;
  double rtol = 0;
  double max_rel_l2 = 0;
};

// Defaults for outputs computed in the given precision with short accumulations. Kernels whose
// error grows with a reduction length use their own (see gemm_tolerance).
inline constexpr Tolerance kFp32Tolerance{1e-5, 1e-5, 1e-6};
inline constexpr Tolerance kBf16Tolerance{1e-2, 1.6e-2, 1e-2};

// fp32 GEMM with reductions of length K and inputs of magnitude <= 1: rounding errors of a sum of
// K products grow like sqrt(K) * eps on random data and like K * eps at worst; the bound below
// takes the worst case over the sizes the tests use with a margin, while an unwritten or wrong
// element (an error of order 1) is still far outside it.
Tolerance gemm_tolerance(long K, double alpha, double beta);

struct Mismatch {
  std::size_t index;
  double got;
  double want;
};

struct CompareReport {
  bool ok = true;
  std::size_t count = 0;       // elements compared
  std::size_t bad = 0;         // outside atol + rtol*|ref|
  std::size_t non_finite = 0;  // NaN or Inf in the output
  double max_abs_err = 0;
  double rel_l2 = 0;
  std::vector<Mismatch> first;  // up to kMaxReported
  std::size_t row_length = 0;   // > 0: indices print as (row, col)
  Tolerance tol;

  static constexpr std::size_t kMaxReported = 8;
  std::string summary() const;  // one line when ok, the first mismatches when not
};

CompareReport compare(std::span<const float> out, std::span<const double> ref, Tolerance tol,
                      std::size_t row_length = 0);

// The same, for outputs checked at a sample of positions: out[k] and ref[k] belong to element
// indices[k] of the full tensor (only used to print where a mismatch is).
CompareReport compare_sampled(std::span<const float> out, std::span<const double> ref,
                              std::span<const std::size_t> indices, Tolerance tol,
                              std::size_t row_length = 0);

}  // namespace k2c
