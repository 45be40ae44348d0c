// fake_gemm.h — the contract of the fake course's submission modules (90_honest ... 97_rubric):
// one function, one right answer. The self-tests hand these modules hostile submissions.
#pragma once

namespace k2c::gemm {

int answer();  // 42

}  // namespace k2c::gemm
