// k2c/device/hopper.cuh — Hopper's (sm_90) asynchronous machinery, one inline-PTX wrapper each,
// and the host call that describes a tensor to the TMA unit.
//
//   mbarrier   a 64-bit shared-memory barrier with a phase bit and a transaction count: the TMA
//              unit "arrives" on it by bytes, threads by arrivals; a phase completes when both
//              reach zero, and waiting means watching the phase bit flip;
//   TMA        cp.async.bulk.tensor: one thread asks for a whole tile, the copy engine fetches
//              it (zero-filling outside the tensor) and signals an mbarrier when it has landed;
//   wgmma      warpgroup MMA: 4 warps issue one asynchronous m64nNk16 whose operands are read
//              from shared memory through 64-bit descriptors;
//   setmaxnreg moves registers between warpgroups: producers give theirs to the consumers.
//
// wgmma and setmaxnreg exist only in the sm_90a feature set: code that uses them must be guarded
// by __CUDA_ARCH_FEAT_SM90_ALL and compiled for sm_90a (CMake CUDA_ARCHITECTURES 90a).
// Uncalled inline device functions are never emitted, so including this header is always safe.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include <cuda_bf16.h>
#include <cuda.h>  // CUtensorMap and its enums (types only: the driver is reached at run time)
#include <cuda_runtime_api.h>

#include "k2c/core/check.h"

namespace k2c::hopper {

// ------------------------------------------------------------------ mbarrier -----------------

__device__ __forceinline__ void mbarrier_init(std::uint32_t bar, std::uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals));
}

// Makes the initialised barriers visible to the other threads and to the async (TMA) proxy;
// follow it with a __syncthreads() before anyone uses them, or with cluster_sync() when other
// blocks of a cluster multicast into them or arrive on them.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(std::uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// One arrival that also tells the barrier to expect `bytes` more from the copy engine.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(std::uint32_t bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// Spins until the phase with parity `parity` has completed. A fresh barrier is in phase 0, and
// the phase "before" it (parity 1) counts as completed: a producer waiting for empty slots
// starts at parity 1 and passes at once.
__device__ __forceinline__ void mbarrier_wait(std::uint32_t bar, std::uint32_t parity) {
  std::uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n"
        " mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// ------------------------------------------------------------------ TMA ----------------------

// The box at (x, y) of the tensor `map` describes (x the contiguous dimension, in elements) into
// shared memory at `dst`. It completes the box's full size in bytes on the mbarrier `bar`, even
// where the box hangs over the tensor's edge and is zero-filled.
__device__ __forceinline__ void tma_load_2d(std::uint32_t dst, const CUtensorMap* map,
                                            std::uint32_t bar, int x, int y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(bar), "r"(x), "r"(y)
      : "memory");
}

// The box at (x, y, z) of a 3-D tensor map (make_tensor_map_bf16_3d), as tma_load_2d.
__device__ __forceinline__ void tma_load_3d(std::uint32_t dst, const CUtensorMap* map,
                                            std::uint32_t bar, int x, int y, int z) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(bar), "r"(x), "r"(y), "r"(z)
      : "memory");
}

// Like tma_load_2d, but the tile lands at the same offset in every CTA of the cluster named in
// `cta_mask`, and completes on the mbarrier at `bar`'s offset in each of them.
__device__ __forceinline__ void tma_load_2d_multicast(std::uint32_t dst, const CUtensorMap* map,
                                                      std::uint32_t bar, int x, int y,
                                                      std::uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(bar), "r"(x), "r"(y), "h"(cta_mask)
      : "memory");
}

// A plain bulk copy (no tensor map, sm_90): `bytes` contiguous bytes from global memory at `src`
// into shared memory at `dst`, completing that many bytes on the mbarrier `bar`. Both addresses
// must be 16-byte aligned and `bytes` a multiple of 16.
__device__ __forceinline__ void bulk_load(std::uint32_t dst, const void* src, std::uint32_t bytes,
                                          std::uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// The other way: the box at (x, y) of `map` written from shared memory at `src` (in the layout a
// load of the same box would produce), clipped at the tensor's edge. The copy runs on its own;
// bulk_commit() closes a group of such stores, and bulk_wait_read<N>() waits until at most N
// groups are still reading shared memory (after which `src` may be overwritten). Shared memory
// written by ordinary stores needs fence_proxy_async() before the store reads it.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, std::uint32_t src, int x, int y) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                   reinterpret_cast<std::uint64_t>(map)),
               "r"(src), "r"(x), "r"(y)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// Waits until every committed store has completed (before a block that issued them exits).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Named barrier `id` (1 to 15; 0 is __syncthreads) among `threads` threads, a multiple of 32: lets
// one warpgroup synchronise without stopping the others.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Counts this warp towards barrier `id` without waiting for it: the other side of a named_sync
// (`threads` is the same total, the syncing threads and the arriving ones together).
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ------------------------------------------------------------------ dependent launches -------
// Programmatic dependent launch (sm_90). A kernel launched with the attribute
// cudaLaunchAttributeProgrammaticStreamSerialization may start while the kernel before it in the
// stream is still running: once every block of that one has called launch_dependents() or exited.
// It must call wait_for_prerequisites() before it touches anything the earlier kernel reads or
// writes (reads of its results, but also writes that could overtake the earlier kernel's): that
// waits until the earlier grid has finished and its writes are visible. (Without the attribute the
// wait returns at once.) What it saves is the gap between the two kernels: the second one's
// launch and ramp-up overlap the first one's last blocks. Both compile to nothing before sm_90.
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prerequisites() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// ------------------------------------------------------------------ clusters -----------------

__device__ __forceinline__ std::uint32_t cluster_rank() {
  std::uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

// Every thread of every CTA in the cluster arrives, then waits for all the others. Not the
// .aligned form: threads of one warp may reach it at different times (a producer warp whose
// lane 0 issued the copies).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// Stores four floats at the address `addr` has in the shared memory of CTA `cta` of the cluster
// (distributed shared memory: `addr` is an offset this CTA would use for its own), and completes
// 16 bytes on the mbarrier at `bar`'s offset in that CTA when they have landed. Nothing orders
// them before anything else: the receiver learns of them from its barrier only.
__device__ __forceinline__ void store_remote_v4(std::uint32_t addr, std::uint32_t bar, std::uint32_t cta, float x,
                                                float y, float z, float w) {
  asm volatile(
      "{\n .reg .b32 ra, rb;\n mapa.shared::cluster.u32 ra, %0, %2;\n mapa.shared::cluster.u32 rb, %1, %2;\n"
      " st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [ra], {%3, %4, %5, %6}, [rb];\n}\n" ::"r"(addr),
      "r"(bar), "r"(cta), "f"(x), "f"(y), "f"(z), "f"(w)
      : "memory");
}

// An arrival on the mbarrier at the same offset as `bar`, in CTA `cta` of the cluster. It keeps
// the default .release.cta ordering, which is enough for what the GEMM announces with it: "my
// reads of my own shared memory are over" (wgmma_wait retired them), after which the peer's TMA
// may overwrite that memory. It is not enough to publish data this thread wrote for the peer to
// read: that needs mbarrier.arrive.release.cluster, which measured about a third slower in a
// GEMM that arrives once per warp and k block.
__device__ __forceinline__ void mbarrier_arrive_cluster(std::uint32_t bar, std::uint32_t cta) {
  asm volatile(
      "{\n .reg .b32 remote;\n mapa.shared::cluster.u32 remote, %0, %1;\n"
      " mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
      "r"(cta)
      : "memory");
}

// ------------------------------------------------------------------ wgmma --------------------

// Orders this warpgroup's register writes (e.g. zeroed accumulators) before the next wgmma.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N committed wgmma groups are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// The descriptor of a K-major operand tile laid out by TMA with 128-byte swizzling: rows of 64
// bf16 (128 bytes), 8-row groups 1024 bytes apart (the stride byte offset), the 16-byte chunks
// of row r XOR-permuted by r % 8. The tile must start on a 1024-byte boundary; the k-th 16-wide
// slice of the row starts 32·k bytes further (the hardware applies the XOR to the final address).
__device__ __forceinline__ std::uint64_t smem_desc_128b(std::uint32_t addr) {
  constexpr std::uint64_t kLeadingOffset = 16 >> 4;   // unused by swizzled K-major layouts
  constexpr std::uint64_t kStrideOffset = 1024 >> 4;  // from one 8-row group to the next
  constexpr std::uint64_t kSwizzle128B = 1;
  return ((addr & 0x3FFFF) >> 4) | (kLeadingOffset << 16) | (kStrideOffset << 32) |
         (kSwizzle128B << 62);
}

// The same layout read as an MN-major operand (attention's V as the B of P·V: rows are k, the 64
// bf16 of a row run along n; module 09's dSᵀ as an A, rows k and m along them). A k16 step spans
// two 8-row groups, 1024 bytes apart (the stride byte offset); an operand wider than 64 along n
// continues in the next 64-wide block of the tile, `block_bytes` further (the leading byte
// offset). Used with the transpose flag set.
__device__ __forceinline__ std::uint64_t smem_desc_128b_mn(std::uint32_t addr, std::uint32_t block_bytes) {
  constexpr std::uint64_t kStrideOffset = 1024 >> 4;
  constexpr std::uint64_t kSwizzle128B = 1;
  return ((addr & 0x3FFFF) >> 4) | (static_cast<std::uint64_t>(block_bytes >> 4) << 16) |
         (kStrideOffset << 32) | (kSwizzle128B << 62);
}

// The same descriptor for an operand `bytes` further on in the same layout (a k slice, the next
// buffer): only the address field, the low 14 bits (address / 16), changes. With `bytes` known at
// compile time this is one add of an immediate.
__device__ __forceinline__ std::uint64_t smem_desc_plus(std::uint64_t desc, std::uint32_t bytes) {
  return desc + (bytes >> 4);
}

// Shared memory written by ordinary stores or cp.async is seen by wgmma (which reads through the
// async proxy) only after this fence, executed by the writing threads before the barrier that
// publishes their data. TMA writes need no fence: they are in the async proxy already.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// d(64×256, fp32) = A(64×16) · B(256×16)ᵀ + (accumulate ? d : 0), both bf16 from shared memory:
// starting a tile with accumulate = 0 saves zeroing 128 registers. Thread t of warp w of
// the warpgroup holds, for n-block j (8 columns): d[4j], d[4j+1] at row 16w + t/4, columns
// 8j + 2(t%4) and +1; d[4j+2], d[4j+3] eight rows lower. kTransA / kTransB = 1 read that operand
// MN-major (its descriptor from smem_desc_128b_mn): module 10's dX and dW.
template <int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], std::uint64_t a_desc,
                                                 std::uint64_t b_desc, int accumulate) {
#define K2C_D8(i)                                                                        \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
  // scale-d is a predicate (p: accumulate into d); scale-a, scale-b = 1; then the transposes.
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
      : K2C_D8(0), K2C_D8(8), K2C_D8(16), K2C_D8(24), K2C_D8(32), K2C_D8(40), K2C_D8(48),
        K2C_D8(56), K2C_D8(64), K2C_D8(72), K2C_D8(80), K2C_D8(88), K2C_D8(96), K2C_D8(104),
        K2C_D8(112), K2C_D8(120)
      : "l"(a_desc), "l"(b_desc), "r"(accumulate), "n"(kTransA), "n"(kTransB));
#undef K2C_D8
}

// The epilogue through TMA stores, in three steps. A warpgroup's m64n256 accumulator d (layout
// above) is four 64 × 64 boxes; `part` counts batches of kBoxes boxes. pack_accumulators converts
// batch `part` to bf16 pairs: out[2·i + h] holds columns 8j + 2q, + 1 of row 16·warp + lane/4 + 8h
// for column block j = part · 8 · kBoxes + i. `part` must be a compile-time constant after
// unrolling (it indexes registers).
template <int kBoxes>
__device__ __forceinline__ void pack_accumulators(const float (&d)[128], int part, std::uint32_t (&out)[16 * kBoxes]) {
#pragma unroll
  for (int i = 0; i < 8 * kBoxes; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int j = part * 8 * kBoxes + i;
      const __nv_bfloat162 v = __floats2bfloat162_rn(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
      out[2 * i + h] = *reinterpret_cast<const std::uint32_t*>(&v);
    }
}

// One batch out: the packed pairs written at `staging` box after box (8 KiB each) in the layout a
// TMA load of the boxes would produce (128-byte rows, the 16-byte chunk c of row r at c ^ (r % 8);
// the swizzle TMA needs also keeps these stores free of bank conflicts: a warp's 8 rows land in 8
// different chunks), then stored by one thread: box b to columns x0 + 64·b (those below x_end) and
// rows y0 .. y0 + 63 of `map`, clipped by TMA at the tensor's edge. `barrier` is a named barrier
// id for the warpgroup's 128 threads. Before writing, one thread waits until the stores issued
// earlier from `staging` have read it. The stores are still running on return; one thread of the
// warpgroup calls bulk_wait_all() before the block ends.
template <int kBoxes>
__device__ __forceinline__ void store_packed(const std::uint32_t (&pk)[16 * kBoxes], std::uint32_t staging,
                                             const CUtensorMap* map, int x0, int x_end, int y0, int barrier) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4, g8 = lane / 4, q = lane % 4;
  const bool leader = threadIdx.x % 128 == 0;
  if (leader) bulk_wait_read<0>();
  named_sync(barrier, 128);
#pragma unroll
  for (int i = 0; i < 8 * kBoxes; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp * 16 + g8 + 8 * h;
      const std::uint32_t at = staging + (i / 8) * 64 * 128 + r * 128 + (((i % 8) ^ (r % 8)) << 4) + 4 * q;
      asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(at), "r"(pk[2 * i + h]));
    }
  fence_proxy_async();  // the copy engine reads what ordinary stores wrote
  named_sync(barrier, 128);
  if (leader) {
    for (int b = 0; b < kBoxes; ++b)
      if (x0 + 64 * b < x_end) tma_store_2d(map, staging + b * 64 * 128, x0 + 64 * b, y0);
    bulk_commit();
  }
}

// A warpgroup's epilogues through TMA stores, tile after tile: the accumulator's 4 / kBoxes
// batches of kBoxes boxes go out through `staging` (kBoxes · 8 KiB) to columns x0 .. x0 + 255 and
// rows y0 .. y0 + 63 of `map`. The last kDefer batches of a tile wait, packed to bf16 in
// registers, until the warpgroup has issued the next tile's first wgmma groups: batch i of them
// goes out once k block i is issued, so that its shared-memory writes overlap the tensor cores'
// work instead of idling them. kDefer = 0: the whole tile at once.
//   after_k_block(kb)  after issuing (committing) the wgmma group of k block kb of a tile
//   tile(d, ...)       at the end of a tile, its accumulator (k_blocks: how many the tile had)
//   finish()           after the last tile; then one thread calls bulk_wait_all()
template <int kBoxes, int kDefer>
struct TmaEpilogue {
  static_assert(kBoxes == 1 || kBoxes == 2 || kBoxes == 4, "a slab is four boxes");
  static constexpr int kBatches = 4 / kBoxes;
  static_assert(kDefer >= 0 && kDefer <= kBatches, "at most every batch is deferred");
  std::uint32_t staging;
  const CUtensorMap* map;
  int x_end, barrier;
  std::uint32_t held[kDefer > 0 ? kDefer : 1][16 * kBoxes];
  int held_x = 0, held_y = -1;  // the held tile's origin; y < 0: nothing held

  __device__ __forceinline__ void after_k_block(int kb) {
    if constexpr (kDefer > 0) {
#pragma unroll
      for (int i = 0; i < kDefer; ++i)
        if (held_y >= 0 && i == kb)
          store_packed<kBoxes>(held[i], staging, map, held_x + 64 * kBoxes * (kBatches - kDefer + i), x_end, held_y,
                               barrier);
      if (kb == kDefer - 1) held_y = -1;
    }
  }
  __device__ __forceinline__ void tile(const float (&d)[128], int x0, int y0, int k_blocks) {
    for (int kb = k_blocks; kb < kDefer; ++kb) after_k_block(kb);  // a tile shorter than the deferral
#pragma unroll
    for (int p = 0; p < kBatches - kDefer; ++p) {
      std::uint32_t pk[16 * kBoxes];
      pack_accumulators<kBoxes>(d, p, pk);
      store_packed<kBoxes>(pk, staging, map, x0 + 64 * kBoxes * p, x_end, y0, barrier);
    }
    if constexpr (kDefer > 0) {
#pragma unroll
      for (int i = 0; i < kDefer; ++i) pack_accumulators<kBoxes>(d, kBatches - kDefer + i, held[i]);
      held_x = x0;
      held_y = y0;
    }
  }
  __device__ __forceinline__ void finish() {
    for (int kb = 0; kb < kDefer; ++kb) after_k_block(kb);
  }
};

// Attention's products (module 09):
//   S(64×64) = Q(64×16)·K(64×16)ᵀ (+ S)    both from shared memory, K-major (no transposes); the
//                                          backward's dQ = dS·K reads both MN-major (kTransA =
//                                          kTransB = 1, the transposes stored as they are)
//   O(64×N) = P(64×16)·V(16×N) + O, N = 64 or 128: P from registers (4 bf16x2 per thread, the mma.sync
//                                          A-fragment layout for the warp's 16 rows), V from
//                                          shared memory read MN-major (transpose flag set)
// Accumulator layout as in wgmma_m64n256k16.
#define K2C_D8(i)                                                                        \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define K2C_REGS32                                                                              \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                      \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define K2C_REGS64 K2C_REGS32 ", "                                                                \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "            \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
template <int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], std::uint64_t a_desc, std::uint64_t b_desc,
                                                   int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" K2C_REGS32 "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
      : K2C_D8(0), K2C_D8(8), K2C_D8(16), K2C_D8(24)
      : "l"(a_desc), "l"(b_desc), "r"(accumulate), "n"(kTransA), "n"(kTransB));
}
__device__ __forceinline__ void wgmma_m64n64k16_rs_tb(float (&d)[32], const std::uint32_t (&a)[4],
                                                      std::uint64_t b_desc) {
  asm volatile(
      "{\n .reg .pred p;\n setp.eq.u32 p, 1, 1;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" K2C_REGS32 "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : K2C_D8(0), K2C_D8(8), K2C_D8(16), K2C_D8(24)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc));
}
__device__ __forceinline__ void wgmma_m64n128k16_rs_tb(float (&d)[64], const std::uint32_t (&a)[4],
                                                       std::uint64_t b_desc) {
  asm volatile(
      "{\n .reg .pred p;\n setp.eq.u32 p, 1, 1;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" K2C_REGS64 "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : K2C_D8(0), K2C_D8(8), K2C_D8(16), K2C_D8(24), K2C_D8(32), K2C_D8(40), K2C_D8(48), K2C_D8(56)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc));
}

// Module 10's tail tiles, where two warpgroups split a tile's 256 columns instead of its 128 rows:
// d(64×128) = A(64×16)·B(128×16)ᵀ (+ d), both from shared memory, into the first 64 registers of
// `d` (the m64n256 accumulator's layout restricted to its first 16 column blocks).
template <int kTransA = 0, int kTransB = 0, int kRegs>
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[kRegs], std::uint64_t a_desc, std::uint64_t b_desc,
                                                    int accumulate) {
  static_assert(kRegs >= 64, "an m64n128 accumulator is 64 registers a thread");
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" K2C_REGS64 "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
      : K2C_D8(0), K2C_D8(8), K2C_D8(16), K2C_D8(24), K2C_D8(32), K2C_D8(40), K2C_D8(48), K2C_D8(56)
      : "l"(a_desc), "l"(b_desc), "r"(accumulate), "n"(kTransA), "n"(kTransB));
}
#undef K2C_REGS64
#undef K2C_REGS32
#undef K2C_D8

// ------------------------------------------------------------------ registers ----------------

// Executed by all warps of a warpgroup: lowers (dec) or raises (inc) its per-thread register cap.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// ------------------------------------------------------------------ host ---------------------

namespace detail {
// A row-major bf16 tensor of `rank` dimensions (dims[0] contiguous, in elements) described for TMA:
// boxes of box[0..rank), 128-byte swizzled, zero-filled outside the tensor. The runtime hands out
// the driver's entry point, so the library links against cudart only.
inline CUtensorMap encode_tensor_map_bf16(const void* base, int rank, const cuuint64_t* dims,
                                          const cuuint32_t* box) {
  using EncodeFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static EncodeFn encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    K2C_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                    cudaEnableDefault, &found));
    K2C_CHECK(fn != nullptr && found == cudaDriverEntryPointSuccess,
              "the CUDA driver has no cuTensorMapEncodeTiled (needs a CUDA 12 driver)");
    return reinterpret_cast<EncodeFn>(fn);
  }();
  cuuint64_t pitch[2] = {};  // bytes from one index of dimension d + 1 to the next
  for (int d = 0; d + 1 < rank; ++d) pitch[d] = (d == 0 ? 2 : pitch[d - 1]) * dims[d];
  const cuuint32_t unit_strides[3] = {1, 1, 1};
  CUtensorMap map{};
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, static_cast<cuuint32_t>(rank),
                            const_cast<void*>(base), dims, pitch, box, unit_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  K2C_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (error "
                                   << static_cast<int>(r) << ") for a " << rank << "-D tensor of "
                                   << dims[rank - 1] << " x ... x " << dims[0] << ", box "
                                   << box[1] << "x" << box[0]);
  return map;
}
inline void check_tensor_map_bf16(const void* base, int rows, int cols, int box_rows, int box_cols) {
  K2C_CHECK(rows >= 1 && cols >= 1, "a TMA tensor needs at least one row and column, got "
                                        << rows << " x " << cols);
  K2C_CHECK(cols % 8 == 0, "TMA rows must start on 16 bytes: cols % 8 == 0, got " << cols);
  K2C_CHECK(reinterpret_cast<std::uintptr_t>(base) % 16 == 0, "a TMA tensor must start on 16 bytes");
  K2C_CHECK(box_rows >= 1 && box_rows <= 256 && box_cols >= 1 && box_cols * 2 <= 128,
            "a 128-byte-swizzled TMA box is at most 256 rows of 64 bf16, got " << box_rows << " x "
                                                                           << box_cols);
}
}  // namespace detail

// A 2-D row-major bf16 tensor (rows × cols, cols contiguous) described for TMA: boxes of
// box_rows × box_cols, 128-byte swizzled, zero-filled outside the tensor. TMA needs a 16-byte
// aligned base and a row pitch that is a multiple of 16 bytes (cols % 8 == 0).
inline CUtensorMap make_tensor_map_bf16(const void* base, int rows, int cols, int box_rows,
                                        int box_cols) {
  detail::check_tensor_map_bf16(base, rows, cols, box_rows, box_cols);
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  return detail::encode_tensor_map_bf16(base, 2, dims, box);
}

// `mats` row-major bf16 matrices of rows × cols, one after another, described as one 3-D tensor
// (column, row, matrix) with boxes of box_rows × box_cols inside one matrix. Unlike the same bytes
// seen as one tall 2-D tensor, a box that hangs past a matrix's last row reads zeros there, not the
// next matrix's first rows.
inline CUtensorMap make_tensor_map_bf16_3d(const void* base, int mats, int rows, int cols,
                                           int box_rows, int box_cols) {
  detail::check_tensor_map_bf16(base, rows, cols, box_rows, box_cols);
  K2C_CHECK(mats >= 1, "a 3-D TMA tensor needs at least one matrix, got " << mats);
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(mats)};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows), 1};
  return detail::encode_tensor_map_bf16(base, 3, dims, box);
}

// ------------------------------------------------------------------ cluster launches --------

// cudaLaunchKernelEx's configuration for blocks of `threads` threads and `smem` bytes of dynamic
// shared memory in clusters of `cluster` along x; with 1 the launch carries no cluster attribute.
// `config` points at `attribute`, so the object is neither copied nor moved (a copy of `config`
// made while it lives, e.g. for an occupancy query, is fine).
struct ClusterLaunch {
  cudaLaunchAttribute attribute{};
  cudaLaunchConfig_t config{};
  ClusterLaunch(int cluster, unsigned threads, int smem, cudaStream_t stream) {
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = cluster;
    attribute.val.clusterDim.y = attribute.val.clusterDim.z = 1;
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = &attribute;
    config.numAttrs = cluster > 1 ? 1 : 0;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;

  // How many blocks of `kernel` the current device holds at once with this configuration, in
  // whole clusters (clusters must fit inside one GPC, so not every SM may find partners).
  template <class Kernel>
  int resident_blocks(Kernel kernel) const {
    int device = 0, sms = 0, count = 0;
    K2C_CUDA_CHECK(cudaGetDevice(&device));
    K2C_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    const int cluster = static_cast<int>(attribute.val.clusterDim.x);
    if (cluster == 1) {
      K2C_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&count, kernel, config.blockDim.x,
                                                                   config.dynamicSmemBytes));
      return count * sms;
    }
    cudaLaunchConfig_t probe = config;
    probe.gridDim = dim3(sms / cluster * cluster);  // any grid of whole clusters
    K2C_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&count, kernel, &probe));
    return count * cluster;
  }
};

// ------------------------------------------------------------------ support ----------------

// Defined once per translation unit (anonymous namespace), because the answer is about the flags
// that file was compiled with: a module's implementation built for sm_90a has the features, a
// test program built for plain sm_90 would not.
namespace {

// Writes 1 when the code running on this device was compiled with the sm_90a features.
__global__ void sm90a_probe_kernel(int* has_features) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *has_features = 1;
#else
  *has_features = 0;
#endif
}

// Whether this file's sm_90a code (wgmma, setmaxnreg, TMA multicast) runs on the current device;
// the reason in *why_not when it does not.
[[maybe_unused]] bool sm90a_supported(std::string* why_not) {
  auto fail = [&](std::string why) {
    if (why_not) *why_not = std::move(why);
    return false;
  };
  int device = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    return fail("no CUDA device");
  }
  if (prop.major != 9 || prop.minor != 0)
    return fail("wgmma needs an sm_90 GPU (H100/H200); this is sm_" + std::to_string(prop.major) +
                std::to_string(prop.minor));
  // The probe reads its own launch's error with cudaGetLastError, which would also consume an
  // error the caller left pending: refuse to probe then, and leave that error in place.
  if (const cudaError_t pending = cudaPeekAtLastError(); pending != cudaSuccess)
    return fail(std::string("a CUDA error is pending (") + cudaGetErrorString(pending) + "); not probing");
  int* flag = nullptr;
  int has = 0;
  if (cudaMalloc(&flag, sizeof(int)) != cudaSuccess) return fail("cudaMalloc failed");
  sm90a_probe_kernel<<<1, 1>>>(flag);
  const cudaError_t launched = cudaGetLastError();
  const cudaError_t copied = cudaMemcpy(&has, flag, sizeof(int), cudaMemcpyDeviceToHost);
  cudaFree(flag);
  if (launched != cudaSuccess || copied != cudaSuccess)
    return fail(std::string("this build has no code for the GPU: ") +
                cudaGetErrorString(launched != cudaSuccess ? launched : copied));
  if (!has)
    return fail("this build's code for the GPU lacks the sm_90a features (configure with "
                "CMAKE_CUDA_ARCHITECTURES=90 or 90a: the module is then built for 90a)");
  return true;
}

// Writes the compute capability this file's code for the device was compiled for (e.g. 900).
__global__ void arch_probe_kernel(int* arch) {
#if defined(__CUDA_ARCH__)
  *arch = __CUDA_ARCH__;
#endif
}

// Whether this file's plain sm_90 code (mbarriers, bulk copies, no sm_90a features) runs on the
// current device: a GPU of compute capability 9.0 or newer running code compiled for it (not, say,
// sm_80 code that the driver compiled from PTX). Asked with a probe launch (synchronous: not
// during a stream capture) and remembered per device once the answer is definite: the probe ran
// and reported its architecture, or the build has no code for this GPU. With a CUDA error pending
// it does not probe and leaves that error in place; after any other failure it answers "no" for
// this call only.
[[maybe_unused]] bool bulk_copies_supported() {
  static std::mutex mutex;
  static std::map<int, bool> known;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();  // no device: nothing of the caller's to keep
    return false;
  }
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = known.find(device); it != known.end()) return it->second;
  if (cudaPeekAtLastError() != cudaSuccess) return false;
  int* flag = nullptr;
  if (cudaMalloc(&flag, sizeof(int)) != cudaSuccess) {
    cudaGetLastError();  // this probe's own failure
    return false;
  }
  int arch = 0;
  const cudaError_t set = cudaMemset(flag, 0, sizeof(int));
  arch_probe_kernel<<<1, 1>>>(flag);
  const cudaError_t launched = cudaGetLastError();  // nothing was pending: this launch's own error
  const cudaError_t copied =
      set == cudaSuccess && launched == cudaSuccess ? cudaMemcpy(&arch, flag, sizeof(int), cudaMemcpyDeviceToHost) : set;
  cudaFree(flag);
  if (launched == cudaErrorNoKernelImageForDevice || launched == cudaErrorInvalidDeviceFunction)
    return known.emplace(device, false).first->second;  // no code for this GPU: a definite no
  if (launched != cudaSuccess || copied != cudaSuccess) return false;
  return known.emplace(device, arch >= 900).first->second;
}

// Throws std::invalid_argument naming `who` and the reason when sm90a_supported() is false. The
// answer costs a launch, so it is asked once per device.
[[maybe_unused]] void require_sm90a(const char* who) {
  static std::mutex mutex;
  static std::map<int, std::string> why_not_on;  // "" = supported
  int device = 0;
  K2C_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  auto known = why_not_on.find(device);
  if (known == why_not_on.end()) {
    std::string why;
    if (sm90a_supported(&why)) why.clear();
    known = why_not_on.emplace(device, why).first;
  }
  K2C_CHECK(known->second.empty(), who << " cannot run here: " << known->second);
}

}  // namespace

}  // namespace k2c::hopper
