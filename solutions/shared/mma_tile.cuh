// solutions/shared/mma_tile.cuh — the pipelined mma.sync GEMM loop of modules 05 and 10: the
// cp.async pipeline's steps (pipeline_prologue, pipeline_advance) and a warp's work on one
// shared-memory stage (mma_stage: the fragment loads and the MT × NT grid of m16n8k16 products,
// k step by k step).
//
// Code the reference solutions share lives in solutions/shared/, not in common/: common/ ships
// to students, and this loop is part of what modules 05 and 10 ask them to write.
//
// The pipelined GEMMs of module 05 (tensor_core_matmul.cu) and module 10 (moe_grouped_gemm.cuh)
// both keep STAGES shared-memory buffers filled by cp.async, one commit group per k tile, and run
// mma_stage once per k tile, between the barrier that publishes a stage and the next one. The
// caller supplies load_stage(s, kt), which issues the copies of k tile kt into buffer s (and does
// not commit them). The two differ only in where a fragment comes from (module 10 also reads
// MN-contiguous operands with ldmatrix .trans), so the caller supplies the loads and this file the
// order: per 16-wide k step, all A fragments, then the B fragments two n8 tiles per ldmatrix_x4,
// then every mma.
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

// The pipeline's prologue: the first STAGES-1 k tiles in flight, one commit group each. Groups
// past the end are committed empty, so the wait count in pipeline_advance stays the same for
// every k tile, the last ones included.
template <int STAGES, class LoadStage>
__device__ __forceinline__ void pipeline_prologue(int k_tiles, LoadStage&& load_stage) {
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    cp_async_commit();
  }
}

// The step before computing on k tile kt (in buffer kt % STAGES). Tile kt has landed once at most
// STAGES-2 younger groups are pending; the barrier also tells every warp that the buffer read in
// iteration kt-1 is free, and it is refilled at once with tile kt + STAGES - 1.
template <int STAGES, class LoadStage>
__device__ __forceinline__ void pipeline_advance(int kt, int k_tiles, LoadStage&& load_stage) {
  cp_async_wait<STAGES - 2>();
  __syncthreads();
  const int next = kt + STAGES - 1;
  if (next < k_tiles) load_stage(next % STAGES, next);
  cp_async_commit();
}

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
