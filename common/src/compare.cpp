// compare.cpp — see k2c/testing/compare.h.
#include "k2c/testing/compare.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace k2c {

Tolerance gemm_tolerance(long K, double alpha, double beta) {
  const double eps = 1.1920929e-7;  // fp32 machine epsilon
  const double scale = std::abs(alpha) * static_cast<double>(std::max(K, 1L)) + std::abs(beta);
  return Tolerance{4 * eps * scale, 1e-5, 1e-5};
}

static CompareReport compare_impl(std::span<const float> out, std::span<const double> ref,
                                  const std::size_t* indices, Tolerance tol,
                                  std::size_t row_length) {
  CompareReport r;
  r.tol = tol;
  r.row_length = row_length;
  r.count = out.size();
  if (out.size() != ref.size()) {
    r.ok = false;
    r.bad = std::max(out.size(), ref.size());
    return r;
  }
  double err2 = 0, ref2 = 0;
  for (std::size_t k = 0; k < out.size(); ++k) {
    const double got = out[k], want = ref[k];
    const bool finite = std::isfinite(got);
    const double err = finite ? std::abs(got - want) : INFINITY;
    if (!finite) ++r.non_finite;
    if (!(err <= tol.atol + tol.rtol * std::abs(want))) {  // written so NaN lands here too
      ++r.bad;
      if (r.first.size() < CompareReport::kMaxReported)
        r.first.push_back({indices ? indices[k] : k, got, want});
    }
    if (finite) {
      r.max_abs_err = std::max(r.max_abs_err, err);
      err2 += err * err;
    }
    ref2 += want * want;
  }
  r.rel_l2 = r.non_finite > 0 ? INFINITY : (ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2));
  r.ok = r.bad == 0 && r.non_finite == 0 && r.rel_l2 <= tol.max_rel_l2;
  return r;
}

CompareReport compare(std::span<const float> out, std::span<const double> ref, Tolerance tol,
                      std::size_t row_length) {
  return compare_impl(out, ref, nullptr, tol, row_length);
}

CompareReport compare_sampled(std::span<const float> out, std::span<const double> ref,
                              std::span<const std::size_t> indices, Tolerance tol,
                              std::size_t row_length) {
  if (indices.size() != out.size()) {
    CompareReport r;
    r.ok = false;
    r.bad = out.size();
    return r;
  }
  return compare_impl(out, ref, indices.data(), tol, row_length);
}

std::string CompareReport::summary() const {
  std::ostringstream os;
  os.precision(7);
  if (count == 0 && bad > 0) return "size mismatch between output and reference";
  os << (ok ? "match: " : "MISMATCH: ") << count << " elements, " << bad
     << " outside atol=" << tol.atol << " + rtol=" << tol.rtol << "*|ref|, " << non_finite
     << " NaN/Inf, max abs err " << max_abs_err << ", rel L2 err " << rel_l2
     << " (limit " << tol.max_rel_l2 << ")";
  for (const Mismatch& m : first) {
    os << "\n    at ";
    if (row_length > 0)
      os << "(" << m.index / row_length << ", " << m.index % row_length << ")";
    else
      os << "[" << m.index << "]";
    os << ": got " << m.got << ", want " << m.want;
  }
  if (bad > first.size()) os << "\n    ... and " << bad - first.size() << " more";
  return os.str();
}

}  // namespace k2c
