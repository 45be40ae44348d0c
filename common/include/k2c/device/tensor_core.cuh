// k2c/device/tensor_core.cuh — the Ampere-style tensor-core instructions, one inline-PTX wrapper
// each.
//
// Module 05 teaches them; modules 09 (FlashAttention) and 10 (MoE) reuse them. Each wrapper is
// the single instruction it names, so SASS reads one-to-one against the source:
//   cp_async_16        LDGSTS: 16 bytes global → shared without passing through registers
//   cp_async_4         the same for 4 bytes (a per-row scalar that rides with a tile)
//   cp_async_arrive    an mbarrier arrival once this thread's copies so far have landed
//   ldmatrix_x4(_trans) LDSM: four 8×8 b16 tiles from shared memory into mma fragments
//   mma_bf16_16816     HMMA.16816.F32.BF16: D(16×8, fp32) += A(16×16, bf16) · B(16×8, bf16)
// All need sm_80 or newer.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

namespace k2c::tc {

// ⌈a / b⌉ for a >= 0, without the overflow of (a + b - 1) / b for a near INT_MAX.
__host__ __device__ constexpr int ceil_div(int a, int b) { return a / b + (a % b != 0); }

// The 32-bit shared-memory address PTX's .shared instructions take.
__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// Copies 16 bytes, or writes 16 zero bytes when `valid` is false (the source size is then 0 and
// `src` is not read, but must still be a valid address: callers pass the tensor's base).
// .cg caches in L2 only: a GEMM operand tile is read once per block, so L1 would only be churned.
__device__ __forceinline__ void cp_async_16(std::uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

// Copies 4 bytes, or writes 4 zero bytes when `valid` is false (src as above). 4-byte copies
// must go through L1 (.ca); they belong to the same commit groups as the 16-byte ones, so a
// scalar per row (module 09's logsumexp) lands with its tile and never occupies a register.
__device__ __forceinline__ void cp_async_4(std::uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}

// Closes the group of copies issued since the last commit; wait<N> blocks until at most N groups
// are still in flight. With one group per pipeline stage, wait<STAGES-2> means "the oldest
// stage has landed".
// The "memory" clobbers keep the compiler from moving ordinary shared-memory reads across them.
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Instead of waiting for a group: the mbarrier at `bar` (shared memory) receives one arrival from
// this thread when all the cp.async it issued before have completed. The arrival is one of those
// the barrier was initialised to expect (.noinc), so a warp that copies a tile for others
// initialises the tile's barrier to 32 and each lane arrives once per fill.
__device__ __forceinline__ void cp_async_arrive(std::uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Lane l supplies the address of row l % 8 of tile l / 8; thread t receives, in register i,
// elements (t / 4, 2·(t % 4)) and (t / 4, 2·(t % 4) + 1) of tile i. That is exactly an mma
// fragment, which is why one instruction feeds the tensor core.
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// The same with each 8×8 tile transposed on the way: for an operand stored with the other
// dimension contiguous (attention's V, stored keys × head_dim, is the B of P·V).
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a · b for one 16×8×16 step of a warp. Fragments (t = lane, g = t / 4, q = t % 4):
//   a[0] = A[g][2q..2q+1]     a[1] = A[g+8][2q..]     a[2] = A[g][2q+8..]    a[3] = A[g+8][2q+8..]
//   b[0] = B[2q..2q+1][g]     b[1] = B[2q+8..2q+9][g]     (B as K×N: a "col" operand)
//   d[0..1] = D[g][2q..2q+1]  d[2..3] = D[g+8][2q..2q+1]
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const std::uint32_t (&a)[4],
                                               const std::uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two fp32 values rounded to bf16 and packed, low half first (the order of a bf16x2 in memory).
__device__ __forceinline__ std::uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&v);
}

}  // namespace k2c::tc
