// lab/moe_grouped.cu — tile shapes of module 10's grouped GEMM at the module's
// shape (16384 tokens × top-6 over 64 experts, uniform loads), against cuBLAS once per expert.
// It compiles the reference solution into itself to reach the kernel's tile parameter:
//   nvcc -O3 -std=c++20 -arch=sm_90a -Icommon/include -Iassignments/05_tensor_core_matmul -Iassignments/10_moe \
//        lab/moe_grouped.cu common/src/device.cu -lcublas -lcuda -o /tmp/moe_grouped && /tmp/moe_grouped [mode]
// Modes, each a function below: `loop` the per-expert loop's timing (loop_timing), `boxes` the
// staged epilogue of Part B, `tails` the split tail tiles, `same` whether splitting them changes
// any output bit, `pairs` clusters of two blocks sharing B tiles, `pingpong` a consumer per tile
// (lecture 10's appendix, §9), `decompose` where the up projection's time goes against one dense
// GEMM, `tiles` the tile counts behind it (host only), `profile` three runs of the up projection
// for a profiler.
#include <cublas_v2.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../solutions/05_tensor_core_matmul/hopper_matmul.cu"  // module 05 Part B, for `decompose`
#include "../solutions/10_moe/moe.cu"
#include "k2c/core/random.h"
#include "median_time.cuh"

namespace k2c::moe {

constexpr int kExperts = 64;

// Every one of 16384 tokens picking 6 distinct experts uniformly (from `seed`).
std::vector<int> uniform_loads(unsigned seed) {
  std::vector<int> counts(kExperts, 0);
  std::mt19937_64 rng(seed);
  for (int t = 0; t < 16384; ++t) {
    std::vector<int> all(kExperts);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    for (int j = 0; j < 6; ++j) ++counts[all[j]];
  }
  return counts;
}

// One grouped GEMM of the module's shape on the device: loads drawn by every one of 16384 tokens
// picking 6 distinct experts uniformly (from `seed`), A [rows][k], B [experts][n][k], C [rows][n].
struct Problem {
  std::vector<int> counts, off;
  int rows, n, k;
  bf16 *a, *b, *c;
  int* d_off;
  Problem(int n_, int k_, unsigned seed) : Problem(n_, k_, uniform_loads(seed)) {}
  // Given loads (one count per expert).
  Problem(int n_, int k_, std::vector<int> counts_) : counts(std::move(counts_)), off(kExperts + 1, 0), n(n_), k(k_) {
    std::partial_sum(counts.begin(), counts.end(), off.begin() + 1);
    rows = off.back();
    cudaMalloc(&a, sizeof(bf16) * rows * k);
    cudaMalloc(&b, sizeof(bf16) * kExperts * n * k);
    cudaMalloc(&c, sizeof(bf16) * rows * n);
    cudaMalloc(&d_off, sizeof(int) * off.size());
    cudaMemcpy(d_off, off.data(), sizeof(int) * off.size(), cudaMemcpyHostToDevice);
    fill_uniform_device(a, static_cast<std::size_t>(rows) * k, 1);
    fill_uniform_device(b, static_cast<std::size_t>(kExperts) * n * k, 2);
  }
  ~Problem() {
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    cudaFree(d_off);
  }
  double flops() const { return 2.0 * rows * n * static_cast<double>(k); }
  // Part B's arguments and tensor maps for the forward form, C staged through TMA stores.
  struct Forward {
    HopperArgs args;
    CUtensorMap a, b, c;
  };
  Forward forward() const {
    return {{kExperts, d_off, 0, n, k, c, true}, hp::make_tensor_map_bf16(a, rows, k, kHopperBM, kHopperBK),
            hp::make_tensor_map_bf16(b, kExperts * n, k, kHopperBoxB, kHopperBK), hp::make_tensor_map_bf16(c, rows, n, 64, 64)};
  }
  // cuBLAS once per expert: row-major C_e = A_e · B_eᵀ as column-major C_eᵀ = B_e · A_eᵀ.
  void loop(cublasHandle_t blas) const {
    const float one = 1, zero = 0;
    for (int e = 0; e < kExperts; ++e)
      cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, n, counts[e], k, &one, b + static_cast<std::size_t>(e) * n * k,
                   CUDA_R_16BF, k, a + static_cast<std::size_t>(off[e]) * k, CUDA_R_16BF, k, &zero,
                   c + static_cast<std::size_t>(off[e]) * n, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  }
};

template <class T>
double rate(const Problem& p) {
  const GemmArgs<bf16> args{kExperts, p.d_off, 0, p.n, p.k, p.a, p.b, p.c, false, true};
  return p.flops() / (median_ms([&] { launch_gemm<Mode::rows, true, true, true, T>(args, nullptr); }, 20) * 1e-3) / 1e12;
}

void experiment() {
  cublasHandle_t blas;
  cublasCreate(&blas);
  for (bool up : {true, false}) {
    const Problem p(up ? 2816 : 2048, up ? 2048 : 1408, 1);
    const double loop = p.flops() / (median_ms([&] { p.loop(blas); }, 20) * 1e-3) / 1e12;
    std::printf("%s projection (n %d, k %d): cuBLAS loop %.1f TFLOP/s\n", up ? "up" : "down", p.n, p.k, loop);
    std::printf("  128x256 2x4 warps 4 stages 1/SM (kept)   %.1f\n", rate<Tile<128, 256, 2, 4, 4, 1>>(p));
    std::printf("  256x128 4x2 warps 4 stages 1/SM          %.1f\n", rate<Tile<256, 128, 4, 2, 4, 1>>(p));
    std::printf("  128x128 2x2 warps 3 stages 2/SM          %.1f\n", rate<Tile<128, 128, 2, 2, 3, 2>>(p));
    std::printf("  128x128 4x2 warps 3 stages 2/SM          %.1f\n", rate<Tile<128, 128, 4, 2, 3, 2>>(p));
    std::printf("  128x128 2x2 warps 5 stages 1/SM          %.1f\n", rate<Tile<128, 128, 2, 2, 5, 1>>(p));
    std::printf("  256x128 4x2 warps 3 stages 1/SM          %.1f\n", rate<Tile<256, 128, 4, 2, 3, 1>>(p));
  }
  std::printf("status: %s\n", cudaGetErrorString(cudaDeviceSynchronize()));
}

// How the per-expert cuBLAS loop's measured rate depends on what ran before it: timed as the
// graded test times it (L2 flushed before every run, CUDA events, medians) on a GPU that was idle
// for 2 s, after 300 back-to-back runs, and in 4 rounds alternating with grouped_gemm_hopper;
// for four draws of the loads.
void loop_timing() {
  cublasHandle_t blas;
  cublasCreate(&blas);
  auto timed = [](const std::function<void()>& f, int repeats) { return median_ms(f, repeats, 0, true); };
  for (unsigned draw = 1; draw <= 4; ++draw) {
    const Problem p(2816, 2048, draw);
    auto loop = [&] { p.loop(blas); };
    auto grouped = [&] { grouped_gemm_hopper(kExperts, p.d_off, p.rows, p.n, p.k, p.a, p.b, p.c); };
    loop();
    grouped();
    cudaDeviceSynchronize();
    std::this_thread::sleep_for(std::chrono::seconds(2));
    const double cold = timed(loop, 10);
    for (int i = 0; i < 300; ++i) loop();
    const double warm = timed(loop, 10);
    std::vector<double> gl, ll;
    for (int r = 0; r < 4; ++r) {
      gl.push_back(timed(grouped, 10));
      ll.push_back(timed(loop, 10));
    }
    std::sort(gl.begin(), gl.end());
    std::sort(ll.begin(), ll.end());
    const double g_ms = (gl[1] + gl[2]) / 2, l_ms = (ll[1] + ll[2]) / 2, f = p.flops() / 1e9;
    std::printf("loads %u (max %d): loop cold %.1f, warm %.1f, alternating %.1f TFLOP/s; wgmma alternating %.1f; ratio %.3f\n",
                draw, *std::max_element(p.counts.begin(), p.counts.end()), f / cold, f / warm, f / l_ms, f / g_ms,
                l_ms / g_ms);
  }
  std::printf("status: %s\n", cudaGetErrorString(cudaDeviceSynchronize()));
}

// Part B's staged epilogue: 4 boxes per consumer at once (3 ring slots), 2 or 1 at a time (4
// slots), with and without the last batch deferred into the next tile, against the loop, up and down projections, timed as the graded test times (L2 flushed,
// medians of 10) in 4 rounds alternating between the variants.
void boxes() {
  cublasHandle_t blas;
  cublasCreate(&blas);
  auto timed = [](const std::function<void()>& f) { return median_ms(f, 10, 2, true); };
  for (bool up : {true, false}) {
    const Problem p(up ? 2816 : 2048, up ? 2048 : 1408, 1);
    const auto [args, map_a, map_b, map_c] = p.forward();
    const std::vector<std::pair<const char*, std::function<void()>>> variants = {
        {"cuBLAS loop", [&] { p.loop(blas); }},
        {"wgmma, direct stores", [&] { launch_hopper<HopperForm::forward, bf16, 0>(map_a, map_b, map_a, args, nullptr); }},
        {"wgmma, 4 boxes, 3 slots", [&] { launch_hopper<HopperForm::forward, bf16, 4>(map_a, map_b, map_c, args, nullptr); }},
        {"wgmma, 2 boxes, 4 slots", [&] { launch_hopper<HopperForm::forward, bf16, 2>(map_a, map_b, map_c, args, nullptr); }},
        {"wgmma, 1 box, 4 slots", [&] { launch_hopper<HopperForm::forward, bf16, 1>(map_a, map_b, map_c, args, nullptr); }},
        {"wgmma, 4 boxes deferred", [&] { launch_hopper<HopperForm::forward, bf16, 4, 1>(map_a, map_b, map_c, args, nullptr); }},
        {"wgmma, 2 boxes, 1 deferred", [&] { launch_hopper<HopperForm::forward, bf16, 2, 1>(map_a, map_b, map_c, args, nullptr); }}};
    std::vector<std::vector<double>> ms(variants.size());
    for (int round = 0; round < 4; ++round)
      for (std::size_t v = 0; v < variants.size(); ++v) ms[v].push_back(timed(variants[v].second));
    std::printf("%s projection (n %d, k %d), TFLOP/s per round:\n", up ? "up" : "down", p.n, p.k);
    for (std::size_t v = 0; v < variants.size(); ++v) {
      std::printf("  %-26s", variants[v].first);
      for (double t : ms[v]) std::printf(" %7.1f", p.flops() / (t * 1e-3) / 1e12);
      std::printf("\n");
    }
  }
  std::printf("status: %s\n", cudaGetErrorString(cudaDeviceSynchronize()));
}

// Times the variants as the graded test times (L2 flushed, medians of 10) in 4 rotating rounds
// (rotating_rounds); prints each variant's TFLOP/s per round and the mean time of its middle two
// rounds, and with a baseline as variant 0 (the loop, or the dense GEMM) the ratio of its mean
// time to each variant's.
using Variants = std::vector<std::pair<const char*, std::function<void()>>>;
void alternate(const Variants& variants, double flops, bool baseline_first) {
  std::vector<std::function<void()>> runs;
  for (const auto& v : variants) runs.push_back(v.second);
  const auto ms = rotating_rounds(runs, 4, [](const std::function<void()>& f) { return median_ms(f, 10, 2, true); });
  std::vector<double> mean(variants.size());
  for (std::size_t v = 0; v < variants.size(); ++v) mean[v] = middle_mean(ms[v]);
  for (std::size_t v = 0; v < variants.size(); ++v) {
    std::printf("  %-36s", variants[v].first);
    for (double t : ms[v]) std::printf(" %7.1f", flops / (t * 1e-3) / 1e12);
    std::printf("   middle mean %.3f ms", mean[v]);
    if (baseline_first) std::printf(", ratio to the first %.3f", mean[0] / mean[v]);
    std::printf("\n");
  }
}

// Tail tiles: Part B as shipped (tail tiles with at most 64 real rows split along columns) against
// the same kernel computing every tile as 128 rows, and split with the epilogue staged two boxes
// at a time (four ring slots), beside the loop; up and down projections, three draws of uniform
// loads, timed by alternate(). Also prints how many of the tiles' rows are real.
void tails() {
  cublasHandle_t blas;
  cublasCreate(&blas);
  for (unsigned draw = 1; draw <= 3; ++draw)
    for (bool up : {true, false}) {
      const Problem p(up ? 2816 : 2048, up ? 2048 : 1408, draw);
      long long computed = 0, split_rows = 0;
      for (int c : p.counts) {
        computed += ceil_div(c, kHopperBM) * kHopperBM;
        split_rows += (c % kHopperBM != 0 && c % kHopperBM <= 64) ? kHopperBM - 64 : 0;
      }
      const auto [args, map_a, map_b, map_c] = p.forward();
      const Variants variants = {
          {"cuBLAS loop", [&] { p.loop(blas); }},
          {"wgmma, 128-row tails", [&] {
             launch_hopper<HopperForm::forward, bf16, kStagedBoxes, 0, false>(map_a, map_b, map_c, args, nullptr);
           }},
          {"wgmma, split tails (shipped)", [&] {
             launch_hopper<HopperForm::forward, bf16, kStagedBoxes, 0, true>(map_a, map_b, map_c, args, nullptr);
           }},
          {"wgmma, split, 2 boxes, 4 slots", [&] {
             launch_hopper<HopperForm::forward, bf16, 2, 0, true>(map_a, map_b, map_c, args, nullptr);
           }}};
      std::printf("loads %u, %s projection (n %d, k %d): rows real / computed %.4f (128-row tails), %.4f (split)\n",
                  draw, up ? "up" : "down", p.n, p.k, double(p.rows) / computed, double(p.rows) / (computed - split_rows));
      alternate(variants, p.flops(), true);
    }
  std::printf("status: %s\n", cudaGetErrorString(cudaDeviceSynchronize()));
}

// Whether two variants of Part B differ in any output bit, on the module's up projection (uniform
// loads, forward form), the dX form at the down projection's dh = d_out W2 (n 1408, k 2048), and
// tiny groups (0 to 3 rows, n 48, k 64) in both forms; outputs compared as bytes. `same` compares
// split tail tiles with 128-row ones, `pairs` clusters of two with one block per tile.
using Launch = void (*)(const CUtensorMap&, const CUtensorMap&, const CUtensorMap&, const HopperArgs&, cudaStream_t);
template <HopperForm kForm>
void compare_variants(Launch first, Launch second) {
  constexpr bool kForward = kForm == HopperForm::forward;
  auto compare = [&](const char* what, int groups, const std::vector<int>& off, int n, int k) {
    const int rows = off.back();
    bf16 *a, *b, *c1, *c2;
    int* d_off;
    cudaMalloc(&a, sizeof(bf16) * rows * k);
    cudaMalloc(&b, sizeof(bf16) * groups * n * k);
    cudaMalloc(&c1, sizeof(bf16) * rows * n);
    cudaMalloc(&c2, sizeof(bf16) * rows * n);
    cudaMalloc(&d_off, sizeof(int) * off.size());
    cudaMemcpy(d_off, off.data(), sizeof(int) * off.size(), cudaMemcpyHostToDevice);
    fill_uniform_device(a, static_cast<std::size_t>(rows) * k, 3);
    fill_uniform_device(b, static_cast<std::size_t>(groups) * n * k, 4);
    const HopperArgs args{groups, d_off, 0, n, k, c1, true};
    HopperArgs args2 = args;
    args2.c = c2;
    const CUtensorMap map_a = hp::make_tensor_map_bf16(a, rows, k, kHopperBM, kHopperBK);
    const CUtensorMap map_b = kForward ? hp::make_tensor_map_bf16(b, groups * n, k, kHopperBoxB, kHopperBK)
                                       : hp::make_tensor_map_bf16(b, groups * k, n, 64, 64);
    const CUtensorMap map_c1 = hp::make_tensor_map_bf16(c1, rows, n, 64, 64), map_c2 = hp::make_tensor_map_bf16(c2, rows, n, 64, 64);
    first(map_a, map_b, map_c1, args, nullptr);
    second(map_a, map_b, map_c2, args2, nullptr);
    std::vector<std::uint16_t> h1(static_cast<std::size_t>(rows) * n), h2(h1.size());
    cudaMemcpy(h1.data(), c1, 2 * h1.size(), cudaMemcpyDeviceToHost);
    cudaMemcpy(h2.data(), c2, 2 * h2.size(), cudaMemcpyDeviceToHost);
    std::size_t differ = 0;
    for (std::size_t i = 0; i < h1.size(); ++i) differ += h1[i] != h2[i];
    std::printf("%-44s %s: %zu of %zu outputs differ\n", what, kForward ? "forward" : "dX", differ, h1.size());
    cudaFree(a), cudaFree(b), cudaFree(c1), cudaFree(c2), cudaFree(d_off);
  };
  const Problem p(2816, 2048, 1);
  if (kForward) compare("up projection, uniform loads", kExperts, p.off, 2816, 2048);
  else compare("dh of the down projection, uniform loads", kExperts, p.off, 1408, 2048);
  std::mt19937_64 rng(5);
  std::vector<int> off{0};
  for (int g = 0; g < 64; ++g) off.push_back(off.back() + static_cast<int>(rng() % 4));
  compare("64 groups of 0 to 3 rows, n 48, k 64", 64, off, 48, 64);
  std::printf("status: %s\n", cudaGetErrorString(cudaDeviceSynchronize()));
}

void same() {
  compare_variants<HopperForm::forward>(launch_hopper<HopperForm::forward, bf16, kStagedBoxes, 0, false>,
                                        launch_hopper<HopperForm::forward, bf16, kStagedBoxes, 0, true>);
  compare_variants<HopperForm::dx>(launch_hopper<HopperForm::dx, bf16, kStagedBoxes, 0, false>,
                                   launch_hopper<HopperForm::dx, bf16, kStagedBoxes, 0, true>);
}

// Pairs: Part B with one block per tile (shipped) against clusters of two that share B tiles,
// beside the loop; the up and down projections (forward form) and the dX form of dh = d_out W2,
// three draws of uniform loads, timed by alternate(); then the bit comparison of the two.
void pairs() {
  cublasHandle_t blas;
  cublasCreate(&blas);
  for (unsigned draw = 1; draw <= 3; ++draw)
    for (int shape = 0; shape < 3; ++shape) {
      const bool forward = shape < 2;
      const Problem p(shape == 0 ? 2816 : shape == 1 ? 2048 : 1408, shape == 0 ? 2048 : shape == 1 ? 1408 : 2048, draw);
      auto [args, map_a, map_b, map_c] = p.forward();
      if (!forward) map_b = hp::make_tensor_map_bf16(p.b, kExperts * p.k, p.n, 64, 64);
      Variants variants = {
          {"cuBLAS loop", [&] { p.loop(blas); }},
          {"wgmma, one block per tile (shipped)", [&] {
             if (forward) launch_hopper<HopperForm::forward, bf16, kStagedBoxes, 0, true, 1>(map_a, map_b, map_c, args, nullptr);
             else launch_hopper<HopperForm::dx, bf16, kStagedBoxes, 0, true, 1>(map_a, map_b, map_c, args, nullptr);
           }},
          {"wgmma, pairs", [&] {
             if (forward) launch_hopper<HopperForm::forward, bf16, kStagedBoxes, 0, true, 2>(map_a, map_b, map_c, args, nullptr);
             else launch_hopper<HopperForm::dx, bf16, kStagedBoxes, 0, true, 2>(map_a, map_b, map_c, args, nullptr);
           }}};
      if (!forward) variants.erase(variants.begin());  // the loop times the forward form only
      std::printf("loads %u, %s (n %d, k %d)\n", draw,
                  shape == 0 ? "up projection" : shape == 1 ? "down projection" : "dX of dh = d_out W2", p.n, p.k);
      alternate(variants, p.flops(), forward);
    }
  compare_variants<HopperForm::forward>(launch_hopper<HopperForm::forward, bf16, kStagedBoxes, 0, true, 1>,
                                        launch_hopper<HopperForm::forward, bf16, kStagedBoxes, 0, true, 2>);
  compare_variants<HopperForm::dx>(launch_hopper<HopperForm::dx, bf16, kStagedBoxes, 0, true, 1>,
                                   launch_hopper<HopperForm::dx, bf16, kStagedBoxes, 0, true, 2>);
}

// ---- pingpong: each consumer its own 128 × 128 tile (lecture 10's appendix, §9) ----------------
//
// Part B's producer and ring, but the two consumers no longer split one 128 × 256 tile: consumer c
// takes every other tile of its block's list (tiles of 128 × 128, c = 0 the even ones), with two
// m64n128 accumulators for the tile's two 64-row halves. A ring slot holds one k block of one
// tile (A 128 × 64, B 128 × 64: 32 KiB) and is used by one consumer, so empty[s] counts 4
// arrivals. The consumers take turns: consumer c starts tile j's main loop once the other one has
// seen tile j − 1's last slot filled (barrier turn[c]), so one consumer's epilogue overlaps the
// other's main loop. The turns are also what keeps the slots' parities apart: without them a
// consumer back early from its epilogue could wait for a slot's lap L while lap L − 1, the other
// consumer's, is still in flight, and the parity test cannot tell lap L from lap L − 2.
// kKeepOne: one wgmma group stays in flight (a consumer alone must keep the tensor cores fed).
constexpr int kPingBN = 128, kPingStageBytes = kHopperTileA + kPingBN * kHopperBK * 2;
constexpr int kPingStaging = 4 * kHopperBox;  // a consumer's 128 × 128 bf16 tile

#define PP_D8(i)                                                                                        \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
// d[kOff .. kOff + 63] (+)= A(64×16)·B(128×16)ᵀ, both K-major in shared memory.
template <int kOff>
__device__ __forceinline__ void pp_wgmma(float (&d)[128], std::uint64_t a, std::uint64_t b, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : PP_D8(kOff), PP_D8(kOff + 8), PP_D8(kOff + 16), PP_D8(kOff + 24), PP_D8(kOff + 32), PP_D8(kOff + 40),
        PP_D8(kOff + 48), PP_D8(kOff + 56)
      : "l"(a), "l"(b), "r"(accumulate));
}
#undef PP_D8

template <int kStages>
constexpr int ping_smem_bytes() {
  return kStages * kPingStageBytes + 2 * kPingStaging + (2 * kStages + 2) * 8 + 1024;
}

template <int kStages, bool kKeepOne>
__global__ void __launch_bounds__(kHopperThreads, 1)
    pingpong_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                    const __grid_constant__ CUtensorMap map_c, HopperArgs p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  const std::uint32_t ring = (smem_addr(smem_raw) + 1023) & ~1023u;
  const std::uint32_t staging = ring + kStages * kPingStageBytes;
  const std::uint32_t bars = staging + 2 * kPingStaging;
  int* prefix = reinterpret_cast<int*>(smem_raw + (bars + 16 * kStages + 16 - smem_addr(smem_raw)));
  auto slot_a = [&](int s) { return ring + s * kPingStageBytes; };
  auto slot_b = [&](int s) { return ring + s * kPingStageBytes + kHopperTileA; };
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (kStages + s); };
  auto turn = [&](int c) { return bars + 8 * (2 * kStages + c); };
  const int tiles_n = ceil_div(p.n, kPingBN), k_blocks = ceil_div(p.k, kHopperBK);
  const int warpgroup = threadIdx.x / 128, lane = threadIdx.x % 32;
  if (threadIdx.x < 32)
    warp_prefix(p.groups, [&](int g) { return ceil_div(p.offsets[g + 1] - p.offsets[g], kHopperBM) * tiles_n; }, prefix);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      hp::mbarrier_init(full(s), 1);
      hp::mbarrier_init(empty(s), 4);  // the warps of the one consumer that uses the slot
    }
    hp::mbarrier_init(turn(0), 1);
    hp::mbarrier_init(turn(1), 1);
    hp::fence_barrier_init();
  }
  __syncthreads();
  const int total = prefix[p.groups];
  struct Where {
    int g, row0, rows, m0, n0;
  };
  auto locate = [&](int t) {
    Where w;
    w.g = group_of(prefix, p.groups, t);
    w.row0 = p.offsets[w.g];
    w.rows = p.offsets[w.g + 1] - w.row0;
    const int tiles_m = ceil_div(w.rows, kHopperBM), local = t - prefix[w.g];
    w.m0 = (local % tiles_m) * kHopperBM;
    w.n0 = (local / tiles_m) * kPingBN;
    return w;
  };

  if (warpgroup == 0) {
    hp::setmaxnreg_dec<24>();
    if (threadIdx.x == 0) {
      int it = 0;
      for (int t = blockIdx.x; t < total; t += gridDim.x) {
        const Where w = locate(t);
        for (int kb = 0; kb < k_blocks; ++kb, ++it) {
          const int s = it % kStages;
          hp::mbarrier_wait(empty(s), ((it / kStages) & 1) ^ 1);
          hp::mbarrier_arrive_expect_tx(full(s), kPingStageBytes);
          hp::tma_load_2d(slot_a(s), &map_a, full(s), kb * kHopperBK, w.row0 + w.m0);
          hp::tma_load_2d(slot_b(s), &map_b, full(s), kb * kHopperBK, w.g * p.n + w.n0);
        }
      }
    }
  } else {
    hp::setmaxnreg_inc<240>();
    const int consumer = warpgroup - 1, warp = (threadIdx.x / 32) % 4, g8 = lane / 4, q = lane % 4;
    const std::uint32_t my_staging = staging + consumer * kPingStaging;
    float d[128];
    int j = consumer;  // this tile's place in the block's list
    for (int t = blockIdx.x + consumer * gridDim.x; t < total; t += 2 * gridDim.x, j += 2) {
      const Where w = locate(t);
      const bool half = w.rows - w.m0 <= 64;  // the lower 64 rows are all past the group's end
      if (j > 0) hp::mbarrier_wait(turn(consumer), ((j - 1) / 2) & 1);  // the other's tile j − 1 is fed
      auto k_loop = [&](auto half_tile) {
        constexpr bool kHalf = decltype(half_tile)::value;
        [[maybe_unused]] int previous = 0;
        for (int kb = 0; kb < k_blocks; ++kb) {
          const int it = j * k_blocks + kb, s = it % kStages;
          hp::mbarrier_wait(full(s), (it / kStages) & 1);
          if (kb == k_blocks - 1 && threadIdx.x % 128 == 0) hp::mbarrier_arrive(turn(1 - consumer));
          hp::wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kHopperBK / 16; ++kk) {
            const std::uint64_t b = hp::smem_desc_128b(slot_b(s) + 32 * kk);
            pp_wgmma<0>(d, hp::smem_desc_128b(slot_a(s) + 32 * kk), b, kb > 0 || kk > 0);
            if constexpr (!kHalf) pp_wgmma<64>(d, hp::smem_desc_128b(slot_a(s) + 64 * 128 + 32 * kk), b, kb > 0 || kk > 0);
          }
          hp::wgmma_commit();
          if constexpr (kKeepOne) {
            if (kb > 0) {
              hp::wgmma_wait<1>();
              if (lane == 0) hp::mbarrier_arrive(empty(previous));
            }
            previous = s;
          } else {
            hp::wgmma_wait<0>();
            if (lane == 0) hp::mbarrier_arrive(empty(s));
          }
        }
        if constexpr (kKeepOne) {
          hp::wgmma_wait<0>();
          if (lane == 0 && k_blocks > 0) hp::mbarrier_arrive(empty(previous));
        }
      };
      if (half) k_loop(std::true_type{});
      else k_loop(std::false_type{});

      // Epilogue: a 64-row half wholly inside the group goes through staging and TMA stores, one
      // that crosses the group's end is stored from registers, one past it not at all.
      const bool staged[2] = {w.rows - w.m0 >= 64, w.rows - w.m0 >= 128};
      const bool leader = threadIdx.x % 128 == 0;
      if (staged[0]) {
        if (leader) hp::bulk_wait_read<0>();
        hp::named_sync(2 + consumer, 128);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          if (!staged[hh]) continue;
#pragma unroll
          for (int jj = 0; jj < 16; ++jj)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int r = warp * 16 + g8 + 8 * h;
              const std::uint32_t at = my_staging + (2 * hh + jj / 8) * kHopperBox + r * 128 + (((jj % 8) ^ (r % 8)) << 4) + 4 * q;
              const float* v = d + 64 * hh + 4 * jj + 2 * h;
              asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(at), "r"(tc::pack_bf16x2(v[0], v[1])));
            }
        }
        hp::fence_proxy_async();
        hp::named_sync(2 + consumer, 128);
        if (leader) {
          for (int hh = 0; hh < 2; ++hh)
            for (int b = 0; b < 2 && staged[hh]; ++b)
              if (w.n0 + 64 * b < p.n)
                hp::tma_store_2d(&map_c, my_staging + (2 * hh + b) * kHopperBox, w.n0 + 64 * b, w.row0 + w.m0 + 64 * hh);
          hp::bulk_commit();
        }
      }
      bf16* c = static_cast<bf16*>(p.c) + static_cast<long long>(w.row0) * p.n;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        if (staged[hh] || (hh == 1 && half)) continue;
#pragma unroll
        for (int jj = 0; jj < 16; ++jj)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = w.m0 + 64 * hh + warp * 16 + g8 + 8 * h, col = w.n0 + 8 * jj + 2 * q;
            if (r < w.rows && col < p.n)
              store_pair(c + static_cast<long long>(r) * p.n + col, col + 1 < p.n, p.pairs, false, d[64 * hh + 4 * jj + 2 * h],
                         d[64 * hh + 4 * jj + 2 * h + 1]);
          }
      }
    }
    if (threadIdx.x % 128 == 0) hp::bulk_wait_all();
  }
#endif
}

template <int kStages, bool kKeepOne>
void launch_pingpong(const CUtensorMap& map_a, const CUtensorMap& map_b, const CUtensorMap& map_c, const HopperArgs& args,
                     cudaStream_t stream) {
  auto* kernel = pingpong_kernel<kStages, kKeepOne>;
  const int smem = ping_smem_bytes<kStages>() + prefix_bytes(args.groups);
  K2C_CHECK(smem <= kSmemLimit, "pingpong: too much shared memory");
  // A consumer passes the turn on at its tile's last k block: with none it would never pass it.
  K2C_CHECK(args.k > 0, "pingpong: k must be positive");
  K2C_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  hp::ClusterLaunch launch(1, kHopperThreads, smem, stream);
  launch.config.gridDim = dim3(launch.resident_blocks(kernel));
  K2C_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, kernel, map_a, map_b, map_c, args));
}

// Pingpong against Part B as shipped and the loop, up and down projections, two draws of uniform
// loads, timed by alternate(); then whether it computes the same bits as Part B.
void pingpong() {
  cublasHandle_t blas;
  cublasCreate(&blas);
  for (unsigned draw = 1; draw <= 2; ++draw)
    for (bool up : {true, false}) {
      const Problem p(up ? 2816 : 2048, up ? 2048 : 1408, draw);
      const auto [args, map_a, map_b, map_c] = p.forward();
      const Variants variants = {
          {"cuBLAS loop", [&] { p.loop(blas); }},
          {"wgmma 128x256 (shipped)", [&] {
             launch_hopper<HopperForm::forward, bf16, kStagedBoxes>(map_a, map_b, map_c, args, nullptr);
           }},
          {"pingpong, 5 slots, 1 in flight", [&] { launch_pingpong<5, true>(map_a, map_b, map_c, args, nullptr); }},
          {"pingpong, 5 slots, wait 0", [&] { launch_pingpong<5, false>(map_a, map_b, map_c, args, nullptr); }},
          {"pingpong, 4 slots, 1 in flight", [&] { launch_pingpong<4, true>(map_a, map_b, map_c, args, nullptr); }}};
      std::printf("loads %u, %s projection (n %d, k %d)\n", draw, up ? "up" : "down", p.n, p.k);
      alternate(variants, p.flops(), true);
    }
  compare_variants<HopperForm::forward>(launch_hopper<HopperForm::forward, bf16, kStagedBoxes>,
                                        launch_pingpong<5, true>);
}

// Where the up projection's time goes, against the graded ceiling (one dense cuBLAS GEMM of the
// same total size, every row against expert 0's weight): Part B as shipped on uniform loads; on
// loads of exactly 1536 rows each (16384 · 6 / 64: no ragged tail tiles); on one group of all
// the rows (the kernel's design on the dense problem: one weight, no groups); module 05's Part B
// on that dense problem; and the grouped kernel with module 05's choices (two boxes staged, one
// batch deferred, four ring slots; clusters of two) on both loads. Timed by alternate() with the
// dense GEMM first, two draws of loads.
void decompose() {
  cublasHandle_t blas;
  cublasCreate(&blas);
  for (unsigned draw = 1; draw <= 2; ++draw) {
    const Problem p(2816, 2048, draw), even(2816, 2048, std::vector<int>(kExperts, 16384 * 6 / kExperts));
    const auto [args, map_a, map_b, map_c] = p.forward();
    const auto [even_args, even_a, even_b, even_c] = even.forward();
    int* one_off;
    cudaMalloc(&one_off, 2 * sizeof(int));
    const int one[2] = {0, p.rows};
    cudaMemcpy(one_off, one, sizeof one, cudaMemcpyHostToDevice);
    HopperArgs one_args = args;
    one_args.groups = 1;
    one_args.offsets = one_off;
    const float alpha = 1, zero = 0;
    const Variants variants = {
        {"dense cuBLAS (the graded ceiling)", [&] {
           cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, p.n, p.rows, p.k, &alpha, p.b, CUDA_R_16BF, p.k, p.a, CUDA_R_16BF,
                        p.k, &zero, p.c, CUDA_R_16BF, p.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
         }},
        {"wgmma grouped, uniform loads (shipped)",
         [&] { launch_hopper<HopperForm::forward, bf16, kStagedBoxes>(map_a, map_b, map_c, args, nullptr); }},
        {"wgmma grouped, 64 x 1536 rows", [&] {
           launch_hopper<HopperForm::forward, bf16, kStagedBoxes>(even_a, even_b, even_c, even_args, nullptr);
         }},
        {"wgmma grouped, 1 group of all rows",
         [&] { launch_hopper<HopperForm::forward, bf16, kStagedBoxes>(map_a, map_b, map_c, one_args, nullptr); }},
        {"module 05 Part B, dense", [&] {
           k2c::tensor_core_matmul::matmul_hopper(p.rows, p.n, p.k, p.a, p.b, p.c);
         }},
        // Module 05's epilogue and clusters on the grouped kernel, on both loads.
        {"grouped, 2 boxes, 1 deferred, 4 slots", [&] {
           launch_hopper<HopperForm::forward, bf16, 2, 1>(map_a, map_b, map_c, args, nullptr);
         }},
        {"64 x 1536, 2 boxes, 1 deferred, 4 slots", [&] {
           launch_hopper<HopperForm::forward, bf16, 2, 1>(even_a, even_b, even_c, even_args, nullptr);
         }},
        {"grouped, pairs", [&] {
           launch_hopper<HopperForm::forward, bf16, kStagedBoxes, 0, true, 2>(map_a, map_b, map_c, args, nullptr);
         }},
        {"64 x 1536, pairs", [&] {
           launch_hopper<HopperForm::forward, bf16, kStagedBoxes, 0, true, 2>(even_a, even_b, even_c, even_args, nullptr);
         }}};
    std::printf("loads %u, up projection (rows %d, n %d, k %d), TFLOP/s per round; ratio = dense time / variant's:\n",
                draw, p.rows, p.n, p.k);
    alternate(variants, p.flops(), true);
    cudaFree(one_off);
  }
  std::printf("status: %s\n", cudaGetErrorString(cudaDeviceSynchronize()));
}

// The tile arithmetic behind decompose's tails, on the host only (no GPU needed): for the two
// draws of uniform loads and for even loads, the up projection's 128 × 256 tiles in the kernel's
// order, a split tail tile (at most 64 real rows) counted as half a tile; the mean per SM, the
// most that one SM takes when block b takes tiles b, b + 132, … (the shipped order), and the most
// if each block instead claimed the next tile when it finished one (list scheduling).
void tile_counts() {
  constexpr int kSms = 132, kTilesN = 2816 / kHopperBN;
  auto report = [&](const char* what, const std::vector<int>& counts) {
    std::vector<double> cost;  // the tiles in the kernel's order: group by group, down each column
    for (int rows : counts)
      for (int n = 0; n < kTilesN; ++n)
        for (int m0 = 0; m0 < rows; m0 += kHopperBM) cost.push_back(rows - m0 <= 64 ? 0.5 : 1.0);
    std::vector<double> stride(kSms, 0.0), claimed(kSms, 0.0);
    for (std::size_t t = 0; t < cost.size(); ++t) {
      stride[t % kSms] += cost[t];
      *std::min_element(claimed.begin(), claimed.end()) += cost[t];
    }
    const double total = std::accumulate(cost.begin(), cost.end(), 0.0);
    std::printf("%-14s tiles %zu, tile-equivalents %.1f, per SM: mean %.2f, most (stride) %.1f, most (claimed) %.1f\n",
                what, cost.size(), total, total / kSms, *std::max_element(stride.begin(), stride.end()),
                *std::max_element(claimed.begin(), claimed.end()));
  };
  report("loads 1", uniform_loads(1));
  report("loads 2", uniform_loads(2));
  report("even loads", std::vector<int>(kExperts, 16384 * 6 / kExperts));
}

// The up projection's Part B kernel, run three times for a profiler (ncu -k regex:hopper_grouped).
void profile() {
  const Problem p(2816, 2048, 1);
  for (int i = 0; i < 3; ++i) grouped_gemm_hopper(kExperts, p.d_off, p.rows, p.n, p.k, p.a, p.b, p.c);
  std::printf("status: %s\n", cudaGetErrorString(cudaDeviceSynchronize()));
}

}  // namespace k2c::moe

int main(int argc, char** argv) {
  const std::map<std::string, void (*)()> modes = {{"loop", k2c::moe::loop_timing}, {"same", k2c::moe::same},
                                                   {"profile", k2c::moe::profile},   {"tails", k2c::moe::tails},
                                                   {"boxes", k2c::moe::boxes},  {"pairs", k2c::moe::pairs},
                                                   {"pingpong", k2c::moe::pingpong}, {"decompose", k2c::moe::decompose},
                                                   {"tiles", k2c::moe::tile_counts}};
  if (argc < 2) {
    k2c::moe::experiment();
    return 0;
  }
  const auto mode = modes.find(argv[1]);
  if (mode == modes.end()) {
    std::fprintf(stderr, "unknown mode '%s': loop, same, profile, tails, boxes, pairs, pingpong, decompose or tiles (none: the tile experiment)\n", argv[1]);
    return 2;
  }
  mode->second();
  return 0;
}
