// k2c/core/gemm_args.h — argument checks shared by every GEMM contract (modules 01–05).
#pragma once

#include "k2c/core/check.h"

namespace k2c {

// C = alpha*A*B + beta*C with A M×K, B K×N, C M×N. A pointer may be null only when nothing
// would be read or written through it.
inline void check_gemm_args(int M, int N, int K, const void* A, const void* B, float beta,
                            const void* C) {
  K2C_CHECK(M >= 0 && N >= 0 && K >= 0,
            "GEMM sizes must be >= 0, got M=" << M << " N=" << N << " K=" << K);
  const bool writes_c = M > 0 && N > 0;
  K2C_CHECK(!writes_c || C != nullptr, "C is null for a " << M << "x" << N << " output");
  K2C_CHECK(!writes_c || K == 0 || (A != nullptr && B != nullptr),
            "A or B is null for M=" << M << " N=" << N << " K=" << K);
  (void)beta;
}

}  // namespace k2c
