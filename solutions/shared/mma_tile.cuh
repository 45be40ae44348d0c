// solutions/shared/mma_tile.cuh — a warp's mma.sync work on one shared-memory stage: the fragment
// loads and the MT × NT grid of m16n8k16 products, k step by k step.
//
// Code the reference solutions share lives in solutions/shared/, not in common/: common/ ships
// to students, and this loop is part of what modules 05 and 10 ask them to write.
//
// The pipelined GEMMs of module 05 (tensor_core_matmul.cu) and module 10 (moe_grouped_gemm.cuh)
// both run this loop once per k tile, between the barrier that publishes a stage and the next
// one. They differ only in where a fragment comes from (module 10 also reads MN-contiguous
// operands with ldmatrix .trans), so the caller supplies the loads and this file the order:
// per 16-wide k step, all A fragments, then the B fragments two n8 tiles per ldmatrix_x4, then
// every mma.
//
// Fragment layout (that of tc::mma_bf16_16816): acc[mt][nt] is the 16×8 fp32 tile at warp rows
// 16·mt, columns 8·nt; thread t holds rows t/4 and t/4 + 8, columns 2·(t%4) and 2·(t%4) + 1.
// load_a(frag, mt, ks) fills frag[0..3], the 16×16 A fragment of m tile mt at k step ks;
// load_b(r, nt, ks) fills r[0..1] with the B fragment of n tile nt and r[2..3] with that of
// n tile nt + 1 (nt even), both at k step ks: one ldmatrix_x4 (or _trans) each, addressed by the
// caller's lane roles and swizzle. Needs sm_80 or newer, as tensor_core.cuh does.
#pragma once

#include <cstdint>

#include "k2c/device/tensor_core.cuh"

namespace k2c::tc {

// acc[mt][nt] += A(mt, k) · B(nt, k)ᵀ over kSteps k steps of 16: one stage of a warp's tile.
// a and b are the caller's fragment registers, overwritten at every k step. They are declared by
// the caller, after acc, because the order of a kernel's local arrays sets the order of the
// accumulators' PTX registers, which ptxas's allocation follows: declared in here they come first
// once inlined, and the kernels of modules 05 and 10 compiled to other registers and schedules
// than with the loop written inline; declared by the caller, to byte-identical SASS.
template <int kSteps, int MT, int NT, class LoadA, class LoadB>
__device__ __forceinline__ void mma_stage(float (&acc)[MT][NT][4], std::uint32_t (&a)[MT][4],
                                          std::uint32_t (&b)[NT][2], LoadA&& load_a,
                                          LoadB&& load_b) {
  static_assert(NT % 2 == 0, "B is read two n8 tiles per ldmatrix_x4");
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) load_a(a[mt], mt, ks);
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {
      std::uint32_t r[4];
      load_b(r, nt, ks);
      b[nt][0] = r[0];
      b[nt][1] = r[1];
      b[nt + 1][0] = r[2];
      b[nt + 1][1] = r[3];
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mma_bf16_16816(acc[mt][nt], a[mt], b[nt]);
  }
}

}  // namespace k2c::tc
