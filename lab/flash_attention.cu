// lab/flash_attention.cu — tile and register-budget variants of module 09's
// kernels at the graded shape (B 4, H 32, N 4096, bf16), causal and not, d = 64 and 128. The
// reference solution is included directly so its TU-internal kernels can be launched with tiles
// it does not pick itself; every variant's output is compared with the shipped configuration's
// (largest difference printed: a variant with a bug shows up there, not in its speed). Lecture
// 09 quotes what this measured. Build and run on an H100/H200 (tools/gpu-check.sh does it with
// K2C_EXPERIMENT=flash_attention, and passes K2C_EXPERIMENT_ARGS):
//   nvcc -O3 -std=c++20 -arch=sm_90a -Icommon/include -Iassignments/09_flash_attention \
//     lab/flash_attention.cu common/src/device.cu -lcuda -o /tmp/fa && /tmp/fa [mode]
// No mode: the tile sweep. "unroll": unrolling, dQ and launch-order variants. "hopper_bwd": Part
// B's wgmma backward beside the shipped mma.sync one, and its probes (what leaving out dQ's adds,
// dQ, and its barrier gains; wrong dQ by design). "rounds": close variants in alternating
// rounds. "hopper_fwd": Part B's forward against the warp-specialised one (TMA, a producer
// warpgroup, 128 x 128 tiles): turns of S alone, 2 slots; turns of P V(j) with S(j+1), 3 slots,
// with the slot released once P V(j) is done, and a tile per block; FA3's full turn (S(j+1)
// issued first, its softmax under P V(j)) with 3 slots (shipped) and 2, and a tile per block;
// d = 128. "hopper_fwd64": the same kernels at d = 64, at the graded shape and
// at the capstone's (B 16, H 12, N 1024), with 2 and 4 ring slots. "capstone": the capstone's
// attention (d = 64, B 16, H 12, N 1024, causal) as course mode calls it, and the backward's passes
// around its kernel. "depth": Part B's backward with its copies one step ahead (shipped) and two,
// at the graded shapes and the capstone's. "pairs": Part B's backward with each block adding its dQ
// block (shipped) and with pairs of blocks (clusters of two) summing theirs first, checked
// against each other on edge shapes, then timed at the graded shapes and the capstone's;
// "pairs_check" the checks alone (for compute-sanitizer). "defer": Part B's backward with each
// step's dQ adds issued at once (shipped) and a step later, under the next step's first products.
// "dq_first": Part B's backward with dV's and dK's products issued before the barrier and dQ's
// after it, all waited for before the adds (DqOrder::after, shipped until this mode's run),
// against dQ's product issued first and its adds under dV's and dK's (first, shipped since), and
// dV, dQ, dK in that order with the adds under dK (between), each checked against after on edge
// shapes, then timed. The probes, pairs and deferred adds keep after's order, and the modes that
// time them use it as their baseline.
// "once": one shipped
// forward, backward and Part B backward for a profiler.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "k2c/core/random.h"
#include "median_time.cuh"
#include "../solutions/09_flash_attention/flash_attention.cu"

namespace fa = k2c::flash_attention;
using bf16 = __nv_bfloat16;
// Part B's backward with dQ's product after dV's and dK's, the order the probes, pairs and
// deferred adds keep (the shipped kernel issues it first: kDqOrder).
template <int D>
using PartBAfter = fa::HopperBackwardTile<D, fa::BackwardProbe::none, 2, false, false, fa::DqOrder::after>;

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

// The kernels' parameters over the buffers: the forward's (into o, lse) and the backward's (from
// o_ref, dout and lse into dq, dk, dv, its workspace in work).
fa::Params forward_params(const fa::Shape& s, const Bufs& b) {
  fa::Params p = fa::make_params(s);
  p.wave_heads = g_wave_heads;
  p.q = b.q, p.k = b.k, p.v = b.v, p.out = b.o, p.lse_out = b.lse;
  return p;
}
fa::Params backward_params(const fa::Shape& s, const Bufs& b) {
  fa::Params p = fa::make_params(s);
  p.wave_heads = g_wave_heads;
  p.q = b.q, p.k = b.k, p.v = b.v, p.o = b.o_ref, p.dout = b.dout, p.lse_in = b.lse;
  p.dq = b.dq, p.dk = b.dk, p.dv = b.dv, p.dot = b.work, p.dq_accum = b.work + fa::dot_floats(s);
  return p;
}

// One forward configuration: `launch` is the solution's launcher for it (mma.sync or wgmma).
void forward_variant(const char* kind, const char* name, const fa::Shape& s, Bufs& b, double flops,
                     void (*launch)(const fa::Params&, const fa::Shape&, cudaStream_t)) {
  const fa::Params p = forward_params(s, b);
  cudaMemset(b.o, 0xff, b.n * sizeof(bf16));  // NaN: what a variant leaves unwritten shows in the difference
  const double ms = median_ms([&] { launch(p, s, nullptr); }, 20);
  std::printf("  %-8s %-34s %7.1f TFLOP/s  (%.3f ms)  max |diff| %.3g\n", kind, name, flops / ms * 1e-9, ms,
              diff(b, b.o, b.o_ref));
}

// One backward configuration: T's tile, on the mma.sync kernel or (kHopper) the wgmma one.
template <class T, bool kHopper = false>
void backward_variant(const char* name, const fa::Shape& s, Bufs& b, double flops) {
  const fa::Params p = backward_params(s, b);
  for (bf16* x : {b.dq, b.dk, b.dv}) cudaMemset(x, 0xff, b.n * sizeof(bf16));  // NaN, as in forward_variant
  const double ms = median_ms(
      [&] {
        if constexpr (kHopper) fa::launch_backward<T, fa::hopper_backward_kernel<T>>(p, s, nullptr);
        else fa::launch_backward<T, fa::backward_kernel<T>>(p, s, nullptr);
      },
      10);
  std::printf("  backward %-34s %7.1f TFLOP/s  (%.3f ms)  max |diff| dq %.3g dk %.3g dv %.3g\n", name,
              2.5 * flops / ms * 1e-9, ms, diff(b, b.dq, b.dq_ref), diff(b, b.dk, b.dk_ref), diff(b, b.dv, b.dv_ref));
}

// What a run measures: the tile sweep, the unrolling / dQ / launch-order variants, the wgmma
// backward beside the shipped one (kept apart: a fault there would end the other runs), or pairs
// of close variants in alternating rounds.
enum class Mode { tiles, unroll, hopper_backward, rounds, hopper_forward, hopper_forward64, capstone, depth, pairs, defer, dq_first };

// Two variants timed in 4 rounds that alternate which runs first (rotating_rounds; medians of 10,
// back to back); prints the rate per round and the ratio of the middle two rounds' mean times
// (first / second).
void rounds(const char* what, double flops, const std::function<void()>& first, const std::function<void()>& second) {
  const auto ms = rotating_rounds({first, second}, 4, [](const std::function<void()>& f) { return median_ms(f, 10); });
  std::printf("  %-58s", what);
  for (int r = 0; r < 4; ++r) std::printf(" %6.1f/%6.1f", flops / ms[0][r] * 1e-9, flops / ms[1][r] * 1e-9);
  std::printf("   second/first rate %.3f\n", middle_mean(ms[0]) / middle_mean(ms[1]));
}

// Part B's backward as shipped against a variant of it: each once (outputs compared), then both
// in alternating rounds; `shipped` and `variant` label the rows, `what` the rounds.
template <class Shipped, class Variant>
void against_shipped(const char* shipped, const char* variant, const char* what, const fa::Shape& s, Bufs& b,
                     double flops) {
  backward_variant<Shipped, true>(shipped, s, b, flops);
  backward_variant<Variant, true>(variant, s, b, flops);
  const fa::Params p = backward_params(s, b);
  rounds(what, 2.5 * flops, [&] { fa::launch_backward<Shipped, fa::hopper_backward_kernel<Shipped>>(p, s, nullptr); },
         [&] { fa::launch_backward<Variant, fa::hopper_backward_kernel<Variant>>(p, s, nullptr); });
}

// B, H, N: the graded shape unless given (hopper_fwd64 also runs the capstone's, B 16 H 12 N 1024).
template <int D>
void sweep(bool causal, Mode mode, int B = 4, int H = 32, int N = 4096) {
  const fa::Shape s{B, H, H, N, N, D, causal, 1.0f / std::sqrt(static_cast<float>(D))};
  const double flops = 4.0 * B * H * double(N) * N * D * (causal ? 0.5 : 1.0);
  Bufs b{};
  b.n = size_t(B) * H * N * D;
  for (bf16** x : {&b.q, &b.k, &b.v, &b.o, &b.o_ref, &b.dout, &b.dq, &b.dk, &b.dv, &b.dq_ref, &b.dk_ref, &b.dv_ref})
    cudaMalloc(x, b.n * sizeof(bf16));
  cudaMalloc(&b.lse, size_t(B) * H * N * sizeof(float));
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
  std::printf("d = %d, %s, B %d H %d N %d\n", D, causal ? "causal" : "not causal", B, H, N);
  using fa::BackwardTile;
  using fa::ForwardTile;
  if (mode == Mode::rounds) {
    // Forward: the shipped tile (warps skip tiles past their diagonal) against the same tile
    // computing them; backward: 16-row against 32-row dQ warp tiles (shipped). Outputs compared
    // once each.
    const fa::Params p = forward_params(s, b);
    if (causal) {
      forward_variant("forward", "computing every tile (no skip)", s, b, flops,
                      fa::launch_forward<ForwardTile<D, 64, 4, 2, D / 16, false>>);
      rounds("forward: no skip / skip (shipped), TFLOP/s", flops,
             [&] { fa::launch_forward<ForwardTile<D, 64, 4, 2, D / 16, false>>(p, s, nullptr); },
             [&] { fa::launch_forward<ForwardTile<D>>(p, s, nullptr); });
      fa::forward(s, b.q, b.k, b.v, b.o_ref, b.lse);
    }
    backward_variant<BackwardTile<D, D / 64, 1, D / 16>>("16-row dQ warp tiles", s, b, flops);
    const fa::Params q = backward_params(s, b);
    using Narrow = BackwardTile<D, D / 64, 1, D / 16>;
    using Shipped = BackwardTile<D>;
    rounds("backward: 16-row dQ tiles / 32-row (shipped), TFLOP/s", 2.5 * flops,
           [&] { fa::launch_backward<Narrow, fa::backward_kernel<Narrow>>(q, s, nullptr); },
           [&] { fa::launch_backward<Shipped, fa::backward_kernel<Shipped>>(q, s, nullptr); });
  } else if (mode == Mode::hopper_forward) {
    if constexpr (D == 128) {
      using First = fa::HopperTile<D>;
      using Serial = fa::HopperWsTile<D, true, 2, fa::kSerial, fa::kClaim>;
      using Grouped = fa::HopperWsTile<D, true, 3, fa::kGrouped, fa::kClaim>;
      using Early = fa::HopperWsTile<D, true, 3, fa::kGrouped, fa::kClaim, true>;
      using Overlap = fa::HopperWsTile<D>;  // shipped
      using Overlap2 = fa::HopperWsTile<D, true, 2, fa::kGroupedOverlap, fa::kClaim>;
      using GroupedOne = fa::HopperWsTile<D, true, 3, fa::kGrouped, fa::kOneTile>;
      using OverlapOne = fa::HopperWsTile<D, true, 3, fa::kGroupedOverlap, fa::kOneTile>;
      forward_variant("wgmma", "first Part B: 128 x 64, 2 warpgroups, 2 blocks", s, b, flops, fa::launch_hopper<First>);
      forward_variant("wgmma", "turns of S alone, persistent, 2 slots", s, b, flops, fa::launch_hopper_ws<Serial>);
      forward_variant("wgmma", "turns of P V(j) + S(j+1), 3 slots", s, b, flops, fa::launch_hopper_ws<Grouped>);
      forward_variant("wgmma", "the same, slot released once P V(j) is done", s, b, flops,
                      fa::launch_hopper_ws<Early>);
      forward_variant("wgmma", "turns of S(j+1) + P V(j), softmax under P V, 3 slots (shipped)", s, b, flops,
                      fa::launch_hopper_ws<Overlap>);
      forward_variant("wgmma", "turns of S(j+1) + P V(j), softmax under P V, 2 slots", s, b, flops,
                      fa::launch_hopper_ws<Overlap2>);
      forward_variant("wgmma", "turns of P V(j) + S(j+1), a tile per block", s, b, flops,
                      fa::launch_hopper_ws<GroupedOne>);
      forward_variant("wgmma", "turns of S(j+1) + P V(j), softmax under P V, a tile per block", s, b, flops,
                      fa::launch_hopper_ws<OverlapOne>);
      const fa::Params p = forward_params(s, b);
      // Timed as the graded test times (L2 overwritten before each of 30 runs), in 6 rounds that
      // rotate which runs first.
      const auto ms = rotating_rounds({[&] { fa::launch_hopper_ws<Serial>(p, s, nullptr); },
                                       [&] { fa::launch_hopper_ws<Grouped>(p, s, nullptr); },
                                       [&] { fa::launch_hopper_ws<Early>(p, s, nullptr); },
                                       [&] { fa::launch_hopper_ws<Overlap>(p, s, nullptr); },
                                       [&] { fa::launch_hopper_ws<Overlap2>(p, s, nullptr); },
                                       [&] { fa::launch_hopper_ws<GroupedOne>(p, s, nullptr); },
                                       [&] { fa::launch_hopper_ws<OverlapOne>(p, s, nullptr); }},
                                      6, graded_ms);
      const char* names[] = {"S alone, 2 slots",       "P V + S",
                             "P V + S, early release", "S + P V, overlap (shipped)",
                             "S + P V, overlap, 2 sl", "P V + S, tile per block",
                             "S + P V, tile per block"};
      for (int v = 0; v < 7; ++v) {
        std::printf("  graded timing, %-27s", names[v]);
        for (double m : ms[v]) std::printf(" %6.1f", flops / m * 1e-9);
        std::printf("   mean of the middle rounds %.1f TFLOP/s\n", flops / middle_mean(ms[v]) * 1e-9);
      }
      fa::forward(s, b.q, b.k, b.v, b.o_ref, b.lse);
    }
  } else if (mode == Mode::hopper_forward64) {
    // The warp-specialised forward at d = 64 (shipped there: the first Part B kernel), with 2 and
    // 4 ring slots (a 64-column tile is half of d = 128's), then the first kernel and the
    // 4-slot one in rotating rounds.
    if constexpr (D == 64) {
      using First = fa::HopperTile<D>;
      using Ws2 = fa::HopperWsTile<D, true, 2, fa::kSerial, fa::kClaim>;
      using Ws4 = fa::HopperWsTile<D, true, 4, fa::kSerial, fa::kClaim>;
      forward_variant("wgmma", "first Part B (shipped at d = 64)", s, b, flops, fa::launch_hopper<First>);
      forward_variant("wgmma", "warp-specialised, turns, 2 slots", s, b, flops, fa::launch_hopper_ws<Ws2>);
      forward_variant("wgmma", "warp-specialised, turns, 4 slots", s, b, flops, fa::launch_hopper_ws<Ws4>);
      forward_variant("wgmma", "warp-specialised, no turns, 4 slots", s, b, flops,
                      fa::launch_hopper_ws<fa::HopperWsTile<D, false, 4, fa::kSerial, fa::kClaim>>);
      const fa::Params p = forward_params(s, b);
      rounds("forward: first Part B / warp-specialised, 4 slots, TFLOP/s", flops,
             [&] { fa::launch_hopper<First>(p, s, nullptr); }, [&] { fa::launch_hopper_ws<Ws4>(p, s, nullptr); });
      rounds("forward: warp-specialised, 2 slots / 4 slots, TFLOP/s", flops,
             [&] { fa::launch_hopper_ws<Ws2>(p, s, nullptr); }, [&] { fa::launch_hopper_ws<Ws4>(p, s, nullptr); });
    }
  } else if (mode == Mode::capstone) {
    // The capstone's attention as its course mode runs it (d = 64: Part B's first forward and
    // Part B's backward), each call whole, then the backward's passes around its kernel alone:
    // D = rowsum(dO * O) with dQ's fp32 sums zeroed, and dQ converted to bf16.
    if constexpr (D == 64) {
      forward_variant("wgmma", "Part B forward (shipped at d = 64)", s, b, flops, fa::launch_hopper<fa::HopperTile<D>>);
      forward_variant("forward", "mma.sync forward (Part A)", s, b, flops, fa::launch_forward<ForwardTile<D>>);
      backward_variant<fa::HopperBackwardTile<D>, true>("Part B (shipped)", s, b, flops);
      backward_variant<BackwardTile<D>>("mma.sync (Part A)", s, b, flops);
      backward_variant<PartBAfter<D>, true>("Part B, dQ after dV and dK (the probe's order)", s, b, flops);
      backward_variant<fa::HopperBackwardTile<D, fa::BackwardProbe::no_dq_adds>, true>("probe: no dQ adds", s, b, flops);
      const fa::Params p = backward_params(s, b);
      const std::size_t rows = static_cast<std::size_t>(s.batch) * s.heads * s.q_len, quads = rows * D / 4;
      const double ms = median_ms(
          [&] {
            fa::launch_dot<D>(p, rows, nullptr);
            fa::dq_convert_kernel<D><<<static_cast<unsigned>((quads + 255) / 256), 256>>>(p, quads);
          },
          20);
      std::printf("  backward's passes around its kernel (D, zeroing, dQ conversion)  (%.3f ms)\n", ms);
    }
  } else if (mode == Mode::depth) {
    // Part B's backward with the copies of Q, dO, lse and D one step ahead (shipped) and two.
    against_shipped<fa::HopperBackwardTile<D>, fa::HopperBackwardTile<D, fa::BackwardProbe::none, 3>>(
        "Part B, copies 1 step ahead", "Part B, copies 2 steps ahead", "backward: 1 step ahead / 2 steps ahead, TFLOP/s", s,
        b, flops);
  } else if (mode == Mode::defer) {
    // Part B's backward with a step's dQ adds where they are (after dV and dK) and one step later,
    // issued while the next step's first products run (kDefer).
    against_shipped<PartBAfter<D>, fa::HopperBackwardTile<D, fa::BackwardProbe::none, 2, false, true>>(
        "Part B, dQ added at once", "Part B, dQ added a step later", "backward: at once / a step later, TFLOP/s", s, b, flops);
  } else if (mode == Mode::dq_first) {
    // Part B's backward with dQ's adds after every product of the step and under dV's and dK's
    // (kDqOrder).
    using Probe = fa::BackwardProbe;
    using After = PartBAfter<D>;
    using First = fa::HopperBackwardTile<D, Probe::none, 2, false, false, fa::DqOrder::first>;
    using Between = fa::HopperBackwardTile<D, Probe::none, 2, false, false, fa::DqOrder::between>;
    against_shipped<After, First>("Part B, dQ added after dV and dK", "Part B, dQ first, added under dV and dK",
                                                      "backward: after / first, TFLOP/s", s, b, flops);
    against_shipped<After, Between>("Part B, dQ added after dV and dK", "Part B, dV dQ dK, added under dK",
                                                        "backward: after / between, TFLOP/s", s, b, flops);
  } else if (mode == Mode::pairs) {
    // Part B's backward with each block adding its dQ block into dq_accum (dQ after dV and dK) and
    // with pairs of blocks summing theirs first (kPair).
    against_shipped<PartBAfter<D>, fa::HopperBackwardTile<D, fa::BackwardProbe::none, 2, true>>(
        "Part B, each block adds its dQ", "Part B, pairs sum their dQ first", "backward: each block / pairs, TFLOP/s", s, b,
        flops);
  } else if (mode == Mode::hopper_backward) {
    backward_variant<BackwardTile<D>>("shipped", s, b, flops);
    backward_variant<fa::HopperBackwardTile<D>, true>("wgmma (Part B), 2 warpgroups x 64 keys", s, b, flops);
    backward_variant<PartBAfter<D>, true>("wgmma (Part B), dQ after dV and dK (the probes' order)", s, b, flops);
    // Probes (wrong results): what dQ's adds, dQ, and the barrier before it cost a step.
    using Probe = fa::BackwardProbe;
    backward_variant<fa::HopperBackwardTile<D, Probe::no_dq_adds>, true>("probe: no dQ adds", s, b, flops);
    backward_variant<fa::HopperBackwardTile<D, Probe::no_dq>, true>("probe: no dQ", s, b, flops);
    backward_variant<fa::HopperBackwardTile<D, Probe::no_dq_no_barrier>, true>("probe: no dQ, no barrier", s, b, flops);
    backward_variant<fa::HopperBackwardTile<D>, true>("wgmma (Part B) again", s, b, flops);
  } else if (mode == Mode::unroll) {
    forward_variant("forward", "128 rows x 64 keys, 4 warps x 32", s, b, flops, fa::launch_forward<ForwardTile<D, 64, 4, 2>>);
    // Q·Kᵀ's head_dim loop unrolled fully (shipped: the ldmatrix of the next k step is issued
    // under this step's mma), by 2, or rolled; then the launch order.
    forward_variant("forward", "128 x 64, Q.K^T unrolled by 2", s, b, flops, fa::launch_forward<ForwardTile<D, 64, 4, 2, 2>>);
    forward_variant("forward", "128 x 64, Q.K^T rolled", s, b, flops, fa::launch_forward<ForwardTile<D, 64, 4, 2, 1>>);
    forward_variant("wgmma", "128 x 64, 2 warpgroups, 2 blocks", s, b, flops, fa::launch_hopper<fa::HopperTile<D, 2, 2>>);
    fa::forward(s, b.q, b.k, b.v, b.o_ref, b.lse);
    backward_variant<BackwardTile<D>>("shipped", s, b, flops);
    backward_variant<BackwardTile<D, D / 64, 2, D / 16, false>>("dQ after a second barrier", s, b, flops);
    backward_variant<BackwardTile<D, D / 64, 1, D / 16>>("16-row dQ warp tiles", s, b, flops);
    backward_variant<BackwardTile<D, 1, 2, 1>>("1 chunk, K.Q^T rolled", s, b, flops);
    backward_variant<BackwardTile<D, 1, 2, D / 16>>("1 chunk, K.Q^T unrolled fully", s, b, flops);
    backward_variant<BackwardTile<D, 2, 2, D / 16>>("2 chunks, unrolled fully", s, b, flops);
    g_wave_heads = 1;
    forward_variant("forward", "shipped, heads one after another", s, b, flops, fa::launch_forward<ForwardTile<D>>);
    forward_variant("wgmma", "shipped, heads one after another", s, b, flops, fa::launch_hopper<fa::HopperTile<D>>);
    backward_variant<BackwardTile<D>>("shipped, heads one after another", s, b, flops);
    g_wave_heads = 0;
  } else {
    forward_variant("forward", "128 rows x 64 keys, 4 warps x 32", s, b, flops, fa::launch_forward<ForwardTile<D, 64, 4, 2>>);
    // The tile sweep: every variant takes the solution's current defaults for the loop unrolling
    // and the backward's dQ placement (an earlier sweep, recorded in lab/results/h200.json,
    // predates them).
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
    backward_variant<BackwardTile<D, 1, 1>>("1 chunk, dQ in 16-row warp tiles", s, b, flops);
  }

  for (void* x : {(void*)b.q, (void*)b.k, (void*)b.v, (void*)b.o, (void*)b.o_ref, (void*)b.dout, (void*)b.dq,
                  (void*)b.dk, (void*)b.dv, (void*)b.dq_ref, (void*)b.dk_ref, (void*)b.dv_ref, (void*)b.lse,
                  (void*)b.work, (void*)b.diff})
    cudaFree(x);
}

}  // namespace

// kPair against the shipped Part B backward on shapes the sweep does not reach: an odd number of
// key blocks (a pair's second block past the last key), grouped query heads, q_len ≠ kv_len with
// the causal mask, both layouts. Prints the largest difference of dq, dk and dv between the two
// (the same products summed in another order: within a bf16 step or two) and whether any is NaN.
bool g_pairs_failed = false;  // a check_pairs difference past its bound

template <int D, class Pair = fa::HopperBackwardTile<D, fa::BackwardProbe::none, 2, true>,
          class One = PartBAfter<D>>
void check_pairs(fa::Shape s, const char* what = "pairs") {
  s.head_dim = D;
  s.scale = 1.0f / std::sqrt(static_cast<float>(D));
  const size_t nq = size_t(s.batch) * s.heads * s.q_len * D, nk = size_t(s.batch) * s.kv_heads * s.kv_len * D;
  bf16 *q, *k, *v, *o, *dout, *dq[2], *dk[2], *dv[2];
  float *lse, *work, *d;
  for (bf16** x : {&q, &o, &dout, &dq[0], &dq[1]}) cudaMalloc(x, nq * sizeof(bf16));
  for (bf16** x : {&k, &v, &dk[0], &dk[1], &dv[0], &dv[1]}) cudaMalloc(x, nk * sizeof(bf16));
  cudaMalloc(&lse, size_t(s.batch) * s.heads * s.q_len * sizeof(float));
  cudaMalloc(&work, fa::backward_workspace_bytes(s));
  cudaMalloc(&d, sizeof(float));
  k2c::fill_uniform_device(q, nq, 11, -2, 2);
  k2c::fill_uniform_device(k, nk, 12, -2, 2);
  k2c::fill_uniform_device(v, nk, 13, -1, 1);
  k2c::fill_uniform_device(dout, nq, 14, -1, 1);
  fa::forward(s, q, k, v, o, lse);
  for (int i = 0; i < 2; ++i) {
    for (bf16* x : {dq[i]}) cudaMemset(x, 0xff, nq * sizeof(bf16));
    for (bf16* x : {dk[i], dv[i]}) cudaMemset(x, 0xff, nk * sizeof(bf16));
    fa::Params p = fa::make_params(s);
    p.q = q, p.k = k, p.v = v, p.o = o, p.dout = dout, p.lse_in = lse;
    p.dq = dq[i], p.dk = dk[i], p.dv = dv[i], p.dot = work, p.dq_accum = work + fa::dot_floats(s);
    const bool tokens = s.layout == fa::Layout::tokens_first;
    if (i == 0) {
      if (tokens) fa::launch_backward<One, fa::hopper_backward_kernel<One, true>>(p, s, nullptr);
      else fa::launch_backward<One, fa::hopper_backward_kernel<One, false>>(p, s, nullptr);
    } else {
      if (tokens) fa::launch_backward<Pair, fa::hopper_backward_kernel<Pair, true>>(p, s, nullptr);
      else fa::launch_backward<Pair, fa::hopper_backward_kernel<Pair, false>>(p, s, nullptr);
    }
  }
  auto worst = [&](const bf16* a, const bf16* c, size_t n) {
    cudaMemset(d, 0, sizeof(float));
    max_diff<<<1024, 256>>>(a, c, n, d);
    float h = 0;
    cudaMemcpy(&h, d, sizeof(float), cudaMemcpyDeviceToHost);
    return h;
  };
  const float ddq = worst(dq[0], dq[1], nq), ddk = worst(dk[0], dk[1], nk), ddv = worst(dv[0], dv[1], nk);
  std::printf("  %s check d %d B %d H %d/%d q %d kv %d %s %s: max |diff| dq %.3g dk %.3g dv %.3g\n", what, D, s.batch,
              s.heads, s.kv_heads, s.q_len, s.kv_len, s.causal ? "causal" : "full",
              s.layout == fa::Layout::tokens_first ? "tokens_first" : "heads_first", ddq, ddk, ddv);
  // A few bf16 steps at these magnitudes: the two sum in different orders. More (or a NaN, counted
  // as 1e30) is a bug, and the run's status says so.
  if (!(std::max({ddq, ddk, ddv}) <= 0.02f)) g_pairs_failed = true;
  for (void* x : {(void*)q, (void*)k, (void*)v, (void*)o, (void*)dout, (void*)dq[0], (void*)dq[1], (void*)dk[0],
                  (void*)dk[1], (void*)dv[0], (void*)dv[1], (void*)lse, (void*)work, (void*)d})
    cudaFree(x);
}

void pair_checks() {
  const fa::Layout heads = fa::Layout::heads_first, tokens = fa::Layout::tokens_first;
  check_pairs<128>({2, 4, 2, 300, 700, 128, true, 0, heads});     // 6 key blocks, 3 pairs; kv_len > q_len
  check_pairs<128>({1, 3, 1, 1000, 1000, 128, true, 0, tokens});  // 8 key blocks
  check_pairs<128>({1, 2, 2, 640, 384, 128, true, 0, heads});     // 3: a pair's second block past the end; q_len > kv_len
  check_pairs<64>({2, 6, 3, 129, 1100, 64, false, 0, heads});     // 9 key blocks
  check_pairs<64>({3, 4, 4, 700, 700, 64, true, 0, tokens});
  check_pairs<64>({1, 8, 2, 96, 96, 64, true, 0, heads});  // one key block
}

// kDefer against the shipped kernel on the same edge shapes.
void defer_checks() {
  const fa::Layout heads = fa::Layout::heads_first, tokens = fa::Layout::tokens_first;
  using D128 = fa::HopperBackwardTile<128, fa::BackwardProbe::none, 2, false, true>;
  using D64 = fa::HopperBackwardTile<64, fa::BackwardProbe::none, 2, false, true>;
  check_pairs<128, D128>({2, 4, 2, 300, 700, 128, true, 0, heads}, "defer");
  check_pairs<128, D128>({1, 2, 2, 640, 384, 128, true, 0, tokens}, "defer");
  check_pairs<64, D64>({2, 6, 3, 129, 1100, 64, false, 0, heads}, "defer");
  check_pairs<64, D64>({3, 4, 4, 700, 700, 64, true, 0, tokens}, "defer");
}

// kDqOrder's first and between against after on the same edge shapes.
void dq_first_checks() {
  const fa::Layout heads = fa::Layout::heads_first, tokens = fa::Layout::tokens_first;
  using Probe = fa::BackwardProbe;
  using F128 = fa::HopperBackwardTile<128, Probe::none, 2, false, false, fa::DqOrder::first>;
  using F64 = fa::HopperBackwardTile<64, Probe::none, 2, false, false, fa::DqOrder::first>;
  using B128 = fa::HopperBackwardTile<128, Probe::none, 2, false, false, fa::DqOrder::between>;
  using B64 = fa::HopperBackwardTile<64, Probe::none, 2, false, false, fa::DqOrder::between>;
  check_pairs<128, F128>({2, 4, 2, 300, 700, 128, true, 0, heads}, "dq first");
  check_pairs<128, F128>({1, 2, 2, 640, 384, 128, true, 0, tokens}, "dq first");
  check_pairs<64, F64>({2, 6, 3, 129, 1100, 64, false, 0, heads}, "dq first");
  check_pairs<64, F64>({3, 4, 4, 700, 700, 64, true, 0, tokens}, "dq first");
  check_pairs<128, B128>({2, 4, 2, 300, 700, 128, true, 0, heads}, "dq between");
  check_pairs<64, B64>({3, 4, 4, 700, 700, 64, true, 0, tokens}, "dq between");
}

// Waits for the GPU and reports its first error, or a pairs check past its bound: the status of
// the run.
int finish() {
  const cudaError_t e = cudaDeviceSynchronize();
  std::printf("%s\n", e != cudaSuccess ? cudaGetErrorString(e) : g_pairs_failed ? "a check against the shipped kernel failed" : "ok");
  return e == cudaSuccess && !g_pairs_failed ? 0 : 1;
}

// One shipped forward and backward, and Part B's backward, at the graded shape (d = 128, causal),
// for a profiler:
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
  fa::backward_hopper(s, t[0], t[1], t[2], t[4], t[3], lse, t[5], t[6], t[7], work);
}

// Arguments: "unroll" runs the unrolling, dQ and launch-order variants, "hopper_bwd" the wgmma
// backward beside the shipped one, "rounds", "hopper_fwd", "hopper_fwd64", "capstone", "depth",
// "pairs", "pairs_check", "defer" and "dq_first" as the header says, "once" one forward and the two backwards for a profiler; none runs the tile
// sweep.
int main(int argc, char** argv) {
  const std::string arg = argc > 1 ? argv[1] : "";
  if (arg == "once") {
    once();
  } else {
    const Mode mode = arg == "unroll"       ? Mode::unroll
                      : arg == "hopper_bwd" ? Mode::hopper_backward
                      : arg == "rounds"     ? Mode::rounds
                      : arg == "hopper_fwd" ? Mode::hopper_forward
                      : arg == "hopper_fwd64" ? Mode::hopper_forward64
                      : arg == "capstone"     ? Mode::capstone
                      : arg == "depth"        ? Mode::depth
                      : arg == "pairs" || arg == "pairs_check" ? Mode::pairs
                      : arg == "defer"        ? Mode::defer
                      : arg == "dq_first"     ? Mode::dq_first
                                            : Mode::tiles;
    if (mode == Mode::capstone) {
      sweep<64>(true, mode, 16, 12, 1024);
    } else if (mode == Mode::dq_first || mode == Mode::defer) {
      if (mode == Mode::dq_first) dq_first_checks();
      else defer_checks();
      sweep<128>(true, mode);
      sweep<128>(false, mode);
      sweep<64>(true, mode);
      sweep<64>(true, mode, 16, 12, 1024);  // the capstone's attention
    } else if (mode == Mode::pairs) {
      pair_checks();
      if (arg == "pairs_check") return finish();
      sweep<128>(true, mode);
      sweep<128>(false, mode);
      sweep<64>(true, mode);
      sweep<64>(true, mode, 16, 12, 1024);  // the capstone's attention
    } else if (mode == Mode::depth) {
      sweep<128>(true, mode);
      sweep<128>(false, mode);
      sweep<64>(true, mode);
      sweep<64>(true, mode, 16, 12, 1024);  // the capstone's attention
    } else if (mode == Mode::hopper_forward64) {
      sweep<64>(true, mode);
      sweep<64>(false, mode);
      sweep<64>(true, mode, 16, 12, 1024);  // the capstone's attention (dense-135M, batch 16)
    } else {
      sweep<128>(true, mode);
      sweep<128>(false, mode);
      sweep<64>(true, mode);
    }
  }
  return finish();
}
