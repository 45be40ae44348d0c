// tools/experiments/flash_attention.cu — tile and register-budget variants of module 09's
// kernels at the graded shape (B 4, H 32, N 4096, bf16), causal and not, d = 64 and 128. The
// reference solution is included directly so its TU-internal kernels can be launched with tiles
// it does not pick itself; every variant's output is compared with the shipped configuration's
// (largest difference printed: a variant with a bug shows up there, not in its speed). Lecture
// 09 quotes what this measured. Build and run on an H100/H200 (tools/gpu-check.sh does it with
// K2C_EXPERIMENT=flash_attention, and passes K2C_EXPERIMENT_ARGS):
//   nvcc -O3 -std=c++20 -arch=sm_90a -Icommon/include -Iassignments/09_flash_attention \
//     tools/experiments/flash_attention.cu common/src/device.cu -lcuda -o /tmp/fa && /tmp/fa [mode]
// No mode: the tile sweep. "unroll": unrolling, dQ and launch-order variants. "hopper_bwd": a
// backward on wgmma (below) beside the shipped one. "once": one shipped forward and backward for
// a profiler.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "k2c/random.h"
#include "median_time.cuh"
#include "../../solutions/09_flash_attention/flash_attention.cu"

// ---- A backward on wgmma (experiment, d = 128) ------------------------------------------------
//
// The shipped backward's structure with Hopper's warpgroup MMA: two warpgroups of 128 threads,
// 64 keys each (128 per block), query steps of 64 rows. Sᵀ = K Qᵀ and dPᵀ = V dOᵀ read both
// operands from shared memory; Pᵀ and dSᵀ go from the accumulators straight into A fragments for
// dV += Pᵀ dO and dK += dSᵀ Q (dO and Q read MN-major); dSᵀ also goes to shared memory, where
// dQ = dS K reads it MN-major as A (and K MN-major as B), each warpgroup a 64-column half of dQ.
// No ldmatrix at all: the mma.sync backward spends most of its stalls waiting for those.
// Tiles as the Hopper forward lays them out (load_tile_sw128: 64-column blocks of rows × 128
// bytes, 128-byte swizzle, 1024-byte aligned). A candidate that the solution does not use, with
// no figures in h200.json yet: run it with the mode "hopper_bwd", whose max |diff| columns
// compare it with the shipped backward.
namespace k2c::flash_attention {
namespace {

template <int D_>
struct HopperBackwardTile {
  static constexpr int D = D_, kKeys = 128, kRows = 64, kThreads = 256;
  static constexpr int kKvBytes = kKeys * D * 2, kRowBytes = kRows * D * 2, kDsBytes = kKeys * kRows * 2;
  static constexpr int kSmemBytes = 2 * kKvBytes + 4 * kRowBytes + kDsBytes + 4 * kRows * 4 + 1024;
};

#define K2C_X_D8(i)                                                                          \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
// d(64×64) (+)= A(64×16)·B(16×64), both from shared memory and both read MN-major (transposed;
// hopper::wgmma_m64n64k16_ss reads both K-major).
__device__ __forceinline__ void wgmma_m64n64k16_ss_tt(float (&d)[32], std::uint64_t a, std::uint64_t b, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 1, 1;\n}\n"
      : K2C_X_D8(0), K2C_X_D8(8), K2C_X_D8(16), K2C_X_D8(24)
      : "l"(a), "l"(b), "r"(accumulate));
}
#undef K2C_X_D8

template <class T>
__global__ void __launch_bounds__(T::kThreads, 1) hopper_backward_kernel(Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  namespace hp = k2c::hopper;
  constexpr int D = T::D, BN = T::kKeys, BM = T::kRows, DT = D / 8, QT = BM / 8;
  static_assert(D == 128, "each warpgroup computes a 64-column half of dQ");
  extern __shared__ unsigned char smem_raw[];
  const std::uint32_t base = (smem_addr(smem_raw) + 1023) & ~1023u;
  const std::uint32_t sK = base, sV = base + T::kKvBytes;
  auto sQ = [&](int t) { return base + 2 * T::kKvBytes + (t & 1) * T::kRowBytes; };
  auto sdO = [&](int t) { return base + 2 * T::kKvBytes + (2 + (t & 1)) * T::kRowBytes; };
  const std::uint32_t sdS = base + 2 * T::kKvBytes + 4 * T::kRowBytes;  // dSᵀ: BN rows × BM, one block
  float* s_lse = reinterpret_cast<float*>(smem_raw + (sdS + T::kDsBytes - smem_addr(smem_raw)));  // [2][BM]
  float* s_dot = s_lse + 2 * BM;

  int rank, g, b;
  launch_place(p.wave_heads, rank, g, b);
  const int n0 = rank * BN;
  const int tid = threadIdx.x, lane = tid % 32, wg = tid / 128, warp = (tid / 32) % 4;
  const Mask mask{p.kv_len, p.kv_len - p.q_len, p.causal};
  const std::size_t kv_row0 = p.kv_rows(b, g) + n0;
  const int first_query = p.causal ? max(0, n0 - mask.offset) : 0;
  const int m_first = first_query / BM;
  const int per_head = first_query < p.q_len ? ceil_div(p.q_len, BM) - m_first : 0;
  const int steps = p.group * per_head;
  auto step_rows = [&](int t, int& m0) {
    m0 = (m_first + t % per_head) * BM;
    return p.q_rows(b, g * p.group + t / per_head);
  };
  auto fetch = [&](int t) {
    int m0;
    const std::size_t r = step_rows(t, m0);
    load_tile_sw128<BM, D, T::kThreads>(sQ(t), p.q + (r + m0) * D, p.q_len - m0, tid);
    load_tile_sw128<BM, D, T::kThreads>(sdO(t), p.dout + (r + m0) * D, p.q_len - m0, tid);
    if (tid < 2 * BM) {
      const int row = tid % BM;
      const bool ok = m0 + row < p.q_len;
      const float* src = tid < BM ? p.lse_in : p.dot;
      float* dst = (tid < BM ? s_lse : s_dot) + (t & 1) * BM + row;
      tc::cp_async_4(smem_addr(dst), ok ? src + r + m0 + row : src, ok);
    }
  };

  load_tile_sw128<BN, D, T::kThreads>(sK, p.k + kv_row0 * D, p.kv_len - n0, tid);
  load_tile_sw128<BN, D, T::kThreads>(sV, p.v + kv_row0 * D, p.kv_len - n0, tid);
  if (steps > 0) fetch(0);
  tc::cp_async_commit();

  float dk[DT][4] = {}, dv[DT][4] = {};  // wgmma_m64n128k16's accumulators as n8 tiles
  const int key_row = 64 * wg + 16 * warp;  // this warp's 16 keys; rows key_row + lane/4 (+8)
  const std::uint32_t k_rows = sK + 64 * wg * 128, v_rows = sV + 64 * wg * 128;
  for (int t = 0; t < steps; ++t) {
    int m0;
    const std::size_t q_row0 = step_rows(t, m0);
    tc::cp_async_wait<0>();
    hp::fence_proxy_async();
    __syncthreads();
    if (t + 1 < steps) fetch(t + 1);
    tc::cp_async_commit();

    // Sᵀ and dPᵀ, the warpgroup's 64 keys × BM queries, D/16 steps along head_dim each, as two
    // groups: Pᵀ is computed from Sᵀ while dPᵀ is still on the tensor cores.
    float sT[QT][4], dpT[QT][4];
    auto slice = [&](std::uint32_t tile, int rows, int kk) {  // the k16 slice kk of a K-major tile
      return hp::smem_desc_128b(tile + (kk / 4) * rows * 128 + (kk % 4) * 32);
    };
    hp::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      hp::wgmma_m64n64k16_ss(reinterpret_cast<float(&)[QT * 4]>(sT), slice(k_rows, BN, kk), slice(sQ(t), BM, kk), kk > 0);
    hp::wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      hp::wgmma_m64n64k16_ss(reinterpret_cast<float(&)[QT * 4]>(dpT), slice(v_rows, BN, kk), slice(sdO(t), BM, kk), kk > 0);
    hp::wgmma_commit();

    // Pᵀ and dSᵀ, as in the mma.sync backward (the accumulator layout is the same per warp).
    const float* lse = s_lse + (t & 1) * BM;
    const float* dot = s_dot + (t & 1) * BM;
    const bool masked = n0 + BN > p.kv_len || (p.causal && n0 + BN - 1 > m0 + mask.offset);
    hp::wgmma_wait<1>();  // Sᵀ
#pragma unroll
    for (int i = 0; i < QT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = n0 + key_row + acc_row(lane, e / 2), col = i * 8 + acc_col(lane) + e % 2;
        float pr = fast_exp2(fmaf(sT[i][e], p.scale_log2, -lse[col] * kLog2e));
        if (masked && mask.hidden(m0 + col, key)) pr = 0.0f;
        sT[i][e] = pr;
      }
    hp::wgmma_wait<0>();  // dPᵀ
#pragma unroll
    for (int i = 0; i < QT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) dpT[i][e] = sT[i][e] * (dpT[i][e] - dot[i * 8 + acc_col(lane) + e % 2]);
    std::uint32_t ap[BM / 16][4], ads[BM / 16][4];
#pragma unroll
    for (int kq = 0; kq < BM / 16; ++kq) {
      accumulators_to_a(ap[kq], sT[2 * kq], sT[2 * kq + 1]);
      accumulators_to_a(ads[kq], dpT[2 * kq], dpT[2 * kq + 1]);
    }
    // dSᵀ to shared memory, rows = keys, 128-byte rows of BM queries, swizzled: the A of dQ.
    // Stored before the wgmma below takes ads as its A operand, whose registers may not even be
    // read until that group has been waited for.
#pragma unroll
    for (int qt = 0; qt < QT; ++qt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = key_row + acc_row(lane, half);
        const std::uint32_t at = sdS + row * 128 + ((qt ^ (row & 7)) << 4) + (lane & 3) * 4;
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(ads[qt / 2][2 * (qt % 2) + half]));
      }

    // dV += Pᵀ dO and dK += dSᵀ Q, k = the BM queries: dO and Q read MN-major.
    hp::wgmma_fence();
#pragma unroll
    for (int kq = 0; kq < BM / 16; ++kq) {
      hp::wgmma_m64n128k16_rs_tb(reinterpret_cast<float(&)[DT * 4]>(dv), ap[kq],
                                 hp::smem_desc_128b_mn(sdO(t) + kq * 16 * 128, BM * 128));
      hp::wgmma_m64n128k16_rs_tb(reinterpret_cast<float(&)[DT * 4]>(dk), ads[kq],
                                 hp::smem_desc_128b_mn(sQ(t) + kq * 16 * 128, BM * 128));
    }
    hp::wgmma_commit();

    hp::fence_proxy_async();  // the dSᵀ stores above, before wgmma reads them
    __syncthreads();

    // dQ (BM × 64 columns of this warpgroup) = dS K, k = the BN keys: dS is dSᵀ read MN-major,
    // K read MN-major (keys are k, head_dim is n).
    float dq[32];
    hp::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      wgmma_m64n64k16_ss_tt(dq, hp::smem_desc_128b_mn(sdS + kk * 16 * 128, BN * 128),
                          hp::smem_desc_128b_mn(sK + wg * BN * 128 + kk * 16 * 128, BN * 128), kk > 0);
    hp::wgmma_commit();
    hp::wgmma_wait<0>();  // dQ, and the dV / dK group above (its A fragments are ap and ads)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = m0 + 16 * warp + acc_row(lane, half);
      if (row >= p.q_len) continue;
      float* dst = p.dq_accum + (q_row0 + row) * D + 64 * wg + acc_col(lane);
#pragma unroll
      for (int j = 0; j < 8; ++j) add_pair(dst + 8 * j, dq[4 * j + 2 * half], dq[4 * j + 2 * half + 1]);
    }
  }
  tc::cp_async_wait<0>();

  store_key_rows(dk, dv, p, b, g, n0 + key_row, lane);
#else
  (void)p;
#endif
}

template <class T>
void launch_hopper_backward(Params p, const Shape& s, cudaStream_t stream) {
  constexpr int D = T::D;
  k2c::hopper::require_sm90a("flash_attention hopper backward (experiment)");
  set_smem(hopper_backward_kernel<T>, T::kSmemBytes);
  const std::size_t rows = static_cast<std::size_t>(s.batch) * s.heads * s.q_len;
  dot_kernel<D><<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(p.dout, p.o, p.dot, rows);
  K2C_CHECK(cudaMemsetAsync(p.dq_accum, 0, rows * D * sizeof(float), stream) == cudaSuccess, "memset");
  const dim3 grid(ceil_div(s.kv_len, T::kKeys), s.kv_heads, s.batch);
  if (p.wave_heads <= 0) p.wave_heads = wave_heads(static_cast<int>(grid.x), 1);
  if (grid.x > 0) hopper_backward_kernel<T><<<grid, T::kThreads, T::kSmemBytes, stream>>>(p);
  K2C_CUDA_CHECK_LAUNCH();
  const std::size_t quads = rows * D / 4;
  dq_convert_kernel<<<static_cast<unsigned>((quads + 255) / 256), 256, 0, stream>>>(
      reinterpret_cast<const float4*>(p.dq_accum), reinterpret_cast<uint2*>(p.dq), p.scale, quads);
  K2C_CUDA_CHECK_LAUNCH();
}

}  // namespace
}  // namespace k2c::flash_attention

namespace fa = k2c::flash_attention;
using bf16 = __nv_bfloat16;

namespace {

// Largest |a − b| over n bf16 values (NaN counts as 1e30).
__global__ void max_diff(const bf16* a, const bf16* b, size_t n, float* out) {
  float m = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const float d = fabsf(__bfloat162float(a[i]) - __bfloat162float(b[i]));
    m = fmaxf(m, d == d ? d : 1e30f);
  }
  atomicMax(reinterpret_cast<int*>(out), __float_as_int(m));
}

// Launch order of the variants: 0 is the solution's (sets of as many heads as the GPU holds,
// heaviest blocks first in each); 1 starts the heads one after another.
int g_wave_heads = 0;

struct Bufs {
  size_t n;
  bf16 *q, *k, *v, *o, *o_ref, *dout, *dq, *dk, *dv, *dq_ref, *dk_ref, *dv_ref;
  float *lse, *work, *diff;
};

float diff(const Bufs& b, const bf16* x, const bf16* y) {
  cudaMemset(b.diff, 0, sizeof(float));
  max_diff<<<1024, 256>>>(x, y, b.n, b.diff);
  float h = 0;
  cudaMemcpy(&h, b.diff, sizeof(float), cudaMemcpyDeviceToHost);
  return h;
}

// One forward configuration: `launch` is the solution's launcher for it (mma.sync or wgmma).
void forward_variant(const char* kind, const char* name, const fa::Shape& s, Bufs& b, double flops,
                     void (*launch)(const fa::Params&, const fa::Shape&, cudaStream_t)) {
  fa::Params p = fa::make_params(s);
  p.wave_heads = g_wave_heads;
  p.q = b.q;
  p.k = b.k;
  p.v = b.v;
  p.out = b.o;
  p.lse_out = b.lse;
  cudaMemset(b.o, 0xff, b.n * sizeof(bf16));  // NaN: what a variant leaves unwritten shows in the difference
  const double ms = median_ms([&] { launch(p, s, nullptr); }, 20);
  std::printf("  %-8s %-34s %7.1f TFLOP/s  (%.3f ms)  max |diff| %.3g\n", kind, name, flops / ms * 1e-9, ms,
              diff(b, b.o, b.o_ref));
}

template <class T, bool kHopper = false>
void backward_variant(const char* name, const fa::Shape& s, Bufs& b, double flops) {
  fa::Params p = fa::make_params(s);
  p.wave_heads = g_wave_heads;
  p.q = b.q;
  p.k = b.k;
  p.v = b.v;
  p.o = b.o_ref;
  p.dout = b.dout;
  p.lse_in = b.lse;
  p.dq = b.dq;
  p.dk = b.dk;
  p.dv = b.dv;
  p.dot = b.work;
  p.dq_accum = b.work + fa::dot_floats(s);
  const double ms = median_ms(
      [&] {
        if constexpr (kHopper) fa::launch_hopper_backward<T>(p, s, nullptr);
        else fa::launch_backward<T>(p, s, nullptr);
      },
      10);
  std::printf("  backward %-34s %7.1f TFLOP/s  (%.3f ms)  max |diff| dq %.3g dk %.3g dv %.3g\n", name,
              2.5 * flops / ms * 1e-9, ms, diff(b, b.dq, b.dq_ref), diff(b, b.dk, b.dk_ref), diff(b, b.dv, b.dv_ref));
}

// What a run measures: the tile sweep, the unrolling / dQ / launch-order variants, or the wgmma
// backward beside the shipped one (kept apart: a fault there would end the other runs).
enum class Mode { tiles, unroll, hopper_backward };

template <int D>
void sweep(bool causal, Mode mode) {
  const fa::Shape s{4, 32, 32, 4096, 4096, D, causal, 1.0f / std::sqrt(static_cast<float>(D))};
  const double flops = 4.0 * 4 * 32 * 4096.0 * 4096 * D * (causal ? 0.5 : 1.0);
  Bufs b{};
  b.n = size_t{4} * 32 * 4096 * D;
  for (bf16** x : {&b.q, &b.k, &b.v, &b.o, &b.o_ref, &b.dout, &b.dq, &b.dk, &b.dv, &b.dq_ref, &b.dk_ref, &b.dv_ref})
    cudaMalloc(x, b.n * sizeof(bf16));
  cudaMalloc(&b.lse, size_t{4} * 32 * 4096 * sizeof(float));
  cudaMalloc(&b.work, fa::backward_workspace_bytes(s));
  cudaMalloc(&b.diff, sizeof(float));
  k2c::fill_uniform_device(b.q, b.n, 1, -2, 2);
  k2c::fill_uniform_device(b.k, b.n, 2, -2, 2);
  k2c::fill_uniform_device(b.v, b.n, 3, -1, 1);
  k2c::fill_uniform_device(b.dout, b.n, 4, -1, 1);
  // The shipped configuration's outputs are the yardstick.
  fa::forward(s, b.q, b.k, b.v, b.o_ref, b.lse);
  fa::backward(s, b.q, b.k, b.v, b.o_ref, b.dout, b.lse, b.dq_ref, b.dk_ref, b.dv_ref, b.work);
  cudaDeviceSynchronize();
  std::printf("d = %d, %s\n", D, causal ? "causal" : "not causal");
  using fa::BackwardTile;
  using fa::ForwardTile;
  if (mode == Mode::hopper_backward) {
    if constexpr (D == 128) {
      backward_variant<BackwardTile<D>>("shipped", s, b, flops);
      backward_variant<fa::HopperBackwardTile<D>, true>("wgmma, 2 warpgroups x 64 keys", s, b, flops);
    }
  } else if (mode == Mode::unroll) {
    forward_variant("forward", "128 rows x 64 keys, 4 warps x 32", s, b, flops, fa::launch_forward<ForwardTile<D, 64, 4, 2>>);
    // Q·Kᵀ's head_dim loop unrolled fully (shipped: the ldmatrix of the next k step is issued
    // under this step's mma), by 2, or rolled; then the launch order.
    forward_variant("forward", "128 x 64, Q.K^T unrolled by 2", s, b, flops, fa::launch_forward<ForwardTile<D, 64, 4, 2, 2>>);
    forward_variant("forward", "128 x 64, Q.K^T rolled", s, b, flops, fa::launch_forward<ForwardTile<D, 64, 4, 2, 1>>);
    forward_variant("wgmma", "128 x 64, 2 warpgroups, 2 blocks", s, b, flops, fa::launch_hopper<fa::HopperTile<D, 2, 2>>);
    fa::forward(s, b.q, b.k, b.v, b.o_ref, b.lse);
    backward_variant<BackwardTile<D>>("shipped", s, b, flops);
    backward_variant<BackwardTile<D, D / 64, 1, D / 16, false>>("dQ after a second barrier", s, b, flops);
    backward_variant<BackwardTile<D, D / 64, 2, D / 16>>("32-row dQ warp tiles", s, b, flops);
    backward_variant<BackwardTile<D, 1, 1, 1>>("1 chunk, K.Q^T rolled", s, b, flops);
    backward_variant<BackwardTile<D, 1, 1, D / 16>>("1 chunk, K.Q^T unrolled fully", s, b, flops);
    backward_variant<BackwardTile<D, 2, 1, D / 16>>("2 chunks, unrolled fully", s, b, flops);
    g_wave_heads = 1;
    forward_variant("forward", "shipped, heads one after another", s, b, flops, fa::launch_forward<ForwardTile<D>>);
    forward_variant("wgmma", "shipped, heads one after another", s, b, flops, fa::launch_hopper<fa::HopperTile<D>>);
    backward_variant<BackwardTile<D>>("shipped, heads one after another", s, b, flops);
    g_wave_heads = 0;
  } else {
    forward_variant("forward", "128 rows x 64 keys, 4 warps x 32", s, b, flops, fa::launch_forward<ForwardTile<D, 64, 4, 2>>);
    // The tile sweep: every variant takes the solution's current defaults for the loop unrolling
    // and the backward's dQ placement (an earlier sweep, recorded in h200.json, predates them).
    forward_variant("forward", "128 x 32, 4 warps x 32", s, b, flops, fa::launch_forward<ForwardTile<D, 32, 4, 2>>);
    forward_variant("forward", "128 x 128, 4 warps x 32", s, b, flops, fa::launch_forward<ForwardTile<D, 128, 4, 2>>);
    forward_variant("forward", "128 x 64, 8 warps x 16", s, b, flops, fa::launch_forward<ForwardTile<D, 64, 8, 1>>);
    forward_variant("forward", "128 x 128, 8 warps x 16", s, b, flops, fa::launch_forward<ForwardTile<D, 128, 8, 1>>);
    forward_variant("forward", "64 x 64, 4 warps x 16", s, b, flops, fa::launch_forward<ForwardTile<D, 64, 4, 1>>);
    forward_variant("forward", "64 x 128, 4 warps x 16", s, b, flops, fa::launch_forward<ForwardTile<D, 128, 4, 1>>);
    forward_variant("wgmma", "64 x 64, 1 warpgroup", s, b, flops, fa::launch_hopper<fa::HopperTile<D, 1, 2>>);
    forward_variant("wgmma", "128 x 64, 2 warpgroups, 2 blocks", s, b, flops, fa::launch_hopper<fa::HopperTile<D, 2, 2>>);
    forward_variant("wgmma", "128 x 64, 2 warpgroups, 1 block", s, b, flops, fa::launch_hopper<fa::HopperTile<D, 2, 1>>);
    fa::forward(s, b.q, b.k, b.v, b.o_ref, b.lse);  // lse for the backward variants
    backward_variant<BackwardTile<D, 1>>("scores in 1 chunk", s, b, flops);
    backward_variant<BackwardTile<D, 2>>("scores in 2 chunks", s, b, flops);
    backward_variant<BackwardTile<D, 4>>("scores in 4 chunks", s, b, flops);
    backward_variant<BackwardTile<D, 1, 2>>("1 chunk, dQ in 32-row warp tiles", s, b, flops);
  }

  for (void* x : {(void*)b.q, (void*)b.k, (void*)b.v, (void*)b.o, (void*)b.o_ref, (void*)b.dout, (void*)b.dq,
                  (void*)b.dk, (void*)b.dv, (void*)b.dq_ref, (void*)b.dk_ref, (void*)b.dv_ref, (void*)b.lse,
                  (void*)b.work, (void*)b.diff})
    cudaFree(x);
}

}  // namespace

// One shipped forward and backward at the graded shape (d = 128, causal), for a profiler:
//   ncu --clock-control none -k regex:"forward_kernel|backward_kernel" ... /tmp/fa once
void once() {
  const fa::Shape s{4, 32, 32, 4096, 4096, 128, true, 1.0f / std::sqrt(128.0f)};
  const size_t n = size_t{4} * 32 * 4096 * 128;
  std::vector<bf16*> t(8);
  for (bf16*& x : t) cudaMalloc(&x, n * sizeof(bf16));
  float *lse, *work;
  cudaMalloc(&lse, size_t{4} * 32 * 4096 * sizeof(float));
  cudaMalloc(&work, fa::backward_workspace_bytes(s));
  for (int i = 0; i < 4; ++i) k2c::fill_uniform_device(t[i], n, i + 1, -1, 1);
  fa::forward(s, t[0], t[1], t[2], t[4], lse);
  fa::backward(s, t[0], t[1], t[2], t[4], t[3], lse, t[5], t[6], t[7], work);
}

// Arguments: "unroll" runs the unrolling, dQ and launch-order variants, "hopper_bwd" the wgmma
// backward beside the shipped one (d = 128), "once" one forward and one backward for a
// profiler; none runs the tile sweep.
int main(int argc, char** argv) {
  const std::string arg = argc > 1 ? argv[1] : "";
  if (arg == "once") {
    once();
  } else {
    const Mode mode = arg == "unroll" ? Mode::unroll : arg == "hopper_bwd" ? Mode::hopper_backward : Mode::tiles;
    sweep<128>(true, mode);
    sweep<128>(false, mode);
    if (mode != Mode::hopper_backward) sweep<64>(true, mode);
  }
  const cudaError_t e = cudaDeviceSynchronize();
  std::printf("%s\n", e == cudaSuccess ? "ok" : cudaGetErrorString(e));
  return e == cudaSuccess ? 0 : 1;
}
