// k2c/device/rows.cuh — building blocks of kernels that process a matrix row by row (modules
// 06–08 and later): fp32 arithmetic on float or bf16 storage, 16-byte vector accesses, reductions
// over the threads of a row, and the choice of how many threads and registers a row gets.
// Module 06's lecture derives each of them; this is their one home.
//
// Layout: a block of (blockDim.x, blockDim.y) threads works on blockDim.y rows at once,
// blockDim.x threads per row (1 to 1024; rows of fewer than 32 threads share a warp). Thread t of
// a row handles the vectors t, t + blockDim.x, t + 2·blockDim.x, ... of that row, so consecutive
// threads touch consecutive 16-byte pieces and a warp-wide access uses every byte of the sectors
// it touches (one full 512-byte request when the row has a warp or more).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace k2c::rows {

// ---- element access ---------------------------------------------------------------------

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <class T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16(v);  // round to nearest even
  else
    return v;
}

// VEC consecutive elements moved as one access (16 bytes when VEC · sizeof(T) == 16).
template <class T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  static_assert(sizeof(T) * VEC <= 16 && (sizeof(T) * VEC & (sizeof(T) * VEC - 1)) == 0,
                "one access moves a power of two of at most 16 bytes");
  T v[VEC];
};
template <class T, int VEC>
__device__ __forceinline__ void load(const T* p, float (&out)[VEC]) {
  const Pack<T, VEC> pk = *reinterpret_cast<const Pack<T, VEC>*>(p);
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] = to_float(pk.v[i]);
}
template <class T, int VEC>
__device__ __forceinline__ void store(T* p, const float (&in)[VEC]) {
  Pack<T, VEC> pk;
#pragma unroll
  for (int i = 0; i < VEC; ++i) pk.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Pack<T, VEC>*>(p) = pk;
}

// The same vector kept as the bits it was loaded as, in a built-in vector type (uint4 for 16
// bytes), and converted to fp32 at each use. The register kernels that hold a whole row between
// its reduction and its output keep it this way: a bf16 row takes half the registers it would as
// floats, and a guarded load (`if (c < cols) bits[it] = load_bits(...)`) into a built-in type
// compiles to one predicated instruction, so all of a thread's loads are issued back to back.
template <int Bytes>
struct BitsOf;
template <>
struct BitsOf<16> { using type = uint4; };
template <>
struct BitsOf<8> { using type = uint2; };
template <>
struct BitsOf<4> { using type = unsigned; };
template <>
struct BitsOf<2> { using type = unsigned short; };
template <class T, int VEC>
using Bits = typename BitsOf<sizeof(T) * VEC>::type;

template <class T, int VEC>
__device__ __forceinline__ Bits<T, VEC> load_bits(const T* p) {
  return *reinterpret_cast<const Bits<T, VEC>*>(p);
}
template <class T, int VEC>
__device__ __forceinline__ void store_bits(T* p, Bits<T, VEC> b) {
  *reinterpret_cast<Bits<T, VEC>*>(p) = b;
}
// Element i of a vector of bits, and back. Written with shifts and masks on the 32-bit words
// rather than through a pointer to the bits, which can make the compiler give them a home in
// local memory.
template <class B>
__device__ __forceinline__ unsigned word(const B& b, int k) {
  if constexpr (std::is_same_v<B, uint4>) return k == 0 ? b.x : k == 1 ? b.y : k == 2 ? b.z : b.w;
  else if constexpr (std::is_same_v<B, uint2>) return k == 0 ? b.x : b.y;
  else return b;
}
template <class B>
__device__ __forceinline__ void set_word(B& b, int k, unsigned w) {
  if constexpr (std::is_same_v<B, uint4>) (k == 0 ? b.x : k == 1 ? b.y : k == 2 ? b.z : b.w) = w;
  else if constexpr (std::is_same_v<B, uint2>) (k == 0 ? b.x : b.y) = w;
  else b = static_cast<B>(w);
}
template <class T, int VEC>
__device__ __forceinline__ void unpack(const Bits<T, VEC>& b, float (&out)[VEC]) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      const unsigned w = word(b, i / 2);  // element 2k is the low half of word k
      out[i] = __uint_as_float(i % 2 ? w & 0xffff0000u : w << 16);
    } else {
      out[i] = __uint_as_float(word(b, i));
    }
  }
}
template <class T, int VEC>
__device__ __forceinline__ Bits<T, VEC> pack(const float (&in)[VEC]) {
  Bits<T, VEC> b{};
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    auto half = [](float v) { return static_cast<unsigned>(__bfloat16_as_ushort(__float2bfloat16(v))); };
    if constexpr (VEC == 1) {
      b = static_cast<Bits<T, VEC>>(half(in[0]));
    } else {
#pragma unroll
      for (int k = 0; k < VEC / 2; ++k) {  // one conversion instruction rounds both halves
        const __nv_bfloat162 two = __floats2bfloat162_rn(in[2 * k], in[2 * k + 1]);
        set_word(b, k, *reinterpret_cast<const unsigned*>(&two));
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) set_word(b, i, __float_as_uint(in[i]));
  }
  return b;
}

// How many vectors a thread may keep as bits: 32 registers of them and 16 vectors at most, which
// leaves room under the 64 registers a thread of a 1024-thread block gets (more spilled in
// ptxas -v: 16-byte vectors × 8 fit in 56 registers, single elements × 32 did not fit in 64).
inline constexpr int kBitsRegisters = 32;
inline constexpr int kMaxBitsVectors = 16;
template <class T, int VEC>
inline constexpr int kMaxBitsIters =
    std::min(kMaxBitsVectors, kBitsRegisters / static_cast<int>((sizeof(T) * VEC + 3) / 4));

// The widest vector (elements of T in 16 bytes) every row of a rows × cols matrix can use:
// rows start on 16-byte boundaries only when cols is a multiple of it and the bases are aligned.
template <class T>
inline constexpr int kVec = 16 / sizeof(T);
inline bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// ---- reductions -------------------------------------------------------------------------

struct Sum {
  __device__ float operator()(float a, float b) const { return a + b; }
  static constexpr float identity = 0.0f;
};
struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
  static constexpr float identity = -__builtin_huge_valf();
};

// Butterfly (xor) shuffle within groups of `width` consecutive lanes (a power of two up to 32):
// after log2(width) steps every lane holds its group's result, no broadcast needed. A row of fewer
// than 32 threads is such a group, since the rows of a block follow one another in its warps.
// width is the same for the whole warp, so every lane takes part in every shuffle it runs.
template <class Op>
__device__ __forceinline__ float warp_all(float v, Op op, int width = 32) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    if (offset < width) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

inline constexpr int kMaxWarpsPerRow = 32;  // 1024 threads
inline constexpr int kMaxRowsPerBlock = 4;  // rows of 32 threads or more: 4 in a 128-thread block

// Shared memory for row_all: one slot per warp of every row of the block (rows of a warp or less
// never use it).
struct RowScratch {
  float warp[kMaxRowsPerBlock][kMaxWarpsPerRow];
};

// Reduces v over the blockDim.x threads of this threadIdx.y; every one of them gets the result.
// A warp or less per row: shuffles only, no shared memory, no barrier. Several: each warp reduces with
// shuffles, the warp results meet in shared memory, and every warp reduces those. Every thread of
// the block must call it (it may contain __syncthreads()). The barrier at the end lets the same
// scratch serve the next call: no fast warp overwrites a slot a slow warp still reads.
template <class Op>
__device__ __forceinline__ float row_all(float v, Op op, RowScratch& scratch) {
  if (blockDim.x <= 32) return warp_all(v, op, blockDim.x);
  v = warp_all(v, op);
  const int warps = blockDim.x / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) scratch.warp[threadIdx.y][warp] = v;
  __syncthreads();
  v = lane < warps ? scratch.warp[threadIdx.y][lane] : Op::identity;
  v = warp_all(v, op);
  __syncthreads();
  return v;
}

// ---- how a row is spread over threads and registers -------------------------------------

// A row of `cols` elements read as vectors of `vec`: `threads` per row (a power of two, from
// min_threads up to 1024) each holding `iters` vectors in registers (a power of two), aiming at
// `target_iters` vectors a thread. More vectors a thread means more loads in flight each, fewer
// threads means more rows per SM and reductions over fewer warps; the best target was measured
// per kernel on an H200 at 4096 bf16 per row (module 06's lecture has the table: softmax 128 × 4,
// RMSNorm forward 256 × 2). Short rows get fewer threads: down to min_threads, so that a
// 128-element row is not spread over a warp of which half would idle; rows longer than
// 1024 × target vectors get more per thread, up to max_iters. fits == false: the row does not fit
// in registers. Blocks have 128 threads or more: a row of fewer shares its block with other rows.
struct RowPlan {
  int threads = 32, iters = 1;
  bool fits = false;
  dim3 block() const { return dim3(threads, threads >= 128 ? 1 : 128 / threads); }
  unsigned blocks(int rows) const { return static_cast<unsigned>((rows + block().y - 1) / block().y); }
};
inline int pow2_at_least(int n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}
inline RowPlan plan_row(int cols, int vec, int max_iters, int target_iters, int min_threads = 32) {
  const int vectors = (cols + vec - 1) / vec;
  RowPlan p;
  p.threads = std::min(1024, std::max(min_threads, pow2_at_least((vectors + target_iters - 1) / target_iters)));
  p.iters = pow2_at_least((vectors + p.threads - 1) / p.threads);
  p.fits = p.iters <= std::max(1, max_iters);
  return p;
}

// Calls f(std::integral_constant<int, I>{}) for the power of two I == iters (1 to MaxIters), so a
// kernel templated on its register count is instantiated only for the counts that can occur.
template <int MaxIters, class F>
void with_iters(int iters, F&& f) {
  static_assert(MaxIters >= 1 && (MaxIters & (MaxIters - 1)) == 0, "MaxIters is a power of two");
  if constexpr (MaxIters >= 1) {
    if (iters == MaxIters) return f(std::integral_constant<int, MaxIters>{});
    if constexpr (MaxIters > 1) with_iters<MaxIters / 2>(iters, f);
  }
}

}  // namespace k2c::rows
