// k2c/testing/sgemm_testing.h — the tests every SGEMM module (01–04) shares.
//
// All of them implement one contract, C = alpha*A*B + beta*C in fp32, row-major, any M, N, K
// (see assignments/01_naive_matmul/naive_matmul.h), so they are checked the same way:
//   check_case     one shape against the double-precision CPU reference, every element; random
//                  C (an unwritten element keeps its old value, far outside the tolerance), or
//                  a C poisoned with NaN when beta == 0 (which must not read C);
//   fixed_cases    awkward shapes: 1×1×1, primes, tails on every side, tall and flat;
//   random_cases   shapes drawn from the run's seed;
//   measure_rate   FLOP/s at a size, after spot-checking that run's output at random positions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "k2c/testing/witness.h"

namespace k2c::sgemm_testing {

using SgemmFn = void (*)(int M, int N, int K, float alpha, const float* A, const float* B,
                         float beta, float* C, cudaStream_t stream);

struct Case {
  int M, N, K;
  float alpha, beta;
};

std::string describe(const Case& c);
std::vector<Case> fixed_cases();
std::vector<Case> beta_zero_cases();
std::vector<Case> random_cases(std::uint64_t seed, int count, int max_dim);

// The body of each SGEMM module's <Module>Contract.Implemented test: calls fn on a 1×1×1 problem (dummy,
// never dereferenced pointers when there is no GPU); fails with the grader's marker for a stub.
void check_implemented(SgemmFn fn);

// Adds a GoogleTest failure (with the first mismatches) when fn gets `c` wrong.
void check_case(SgemmFn fn, const Case& c);

// Times fn at M×N×K (median of `repeats` after warm-up, L2 flushed) and returns FLOP/s. Checks
// the output of one run with beta != 0 at 512 seeded positions before timing, and the output of
// the timed runs (beta == 0) at 256 positions drawn afresh after them; a wrong result fails the
// test and returns 0.
double measure_rate(SgemmFn fn, int M, int N, int K, int repeats);

// One launch of the grader's witness `sgemm` (k2c/testing/witness.h): fn at the witness's
// M, N and K with alpha 1 and beta 0, on its buffers A, B and C. Each module registers it:
//   K2C_WITNESS(sgemm) { st::run_witness(kMatmul, w); }
void run_witness(SgemmFn fn, const testing::WitnessLaunch& w);

}  // namespace k2c::sgemm_testing
