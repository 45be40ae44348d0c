// moe_baseline.cu — the naive MoE layer (see k2c/reference/moe_baseline.h).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <random>
#include <vector>

#include "k2c/core/check.h"
#include "k2c/device/buffer.h"
#include "k2c/reference/moe_baseline.h"

namespace k2c::baseline {
namespace {

using bf16 = __nv_bfloat16;

__global__ void softmax_kernel(int tokens, int experts, const float* logits, float* probs) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  const float* z = logits + static_cast<long long>(t) * experts;
  float m = -INFINITY, sum = 0;
  for (int e = 0; e < experts; ++e) m = fmaxf(m, z[e]);
  for (int e = 0; e < experts; ++e) sum += expf(z[e] - m);
  for (int e = 0; e < experts; ++e) probs[static_cast<long long>(t) * experts + e] = expf(z[e] - m) / sum;
}

__global__ void topk_kernel(int tokens, int experts, int k, const float* probs, int* expert, float* weight) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  const float* p = probs + static_cast<long long>(t) * experts;
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int e = 0; e < experts; ++e) {
      bool taken = false;
      for (int i = 0; i < j; ++i) taken |= expert[static_cast<long long>(t) * k + i] == e;
      if (!taken && (best < 0 || p[e] > p[best])) best = e;
    }
    expert[static_cast<long long>(t) * k + j] = best;
    weight[static_cast<long long>(t) * k + j] = p[best];
  }
}

// Every choice of expert e appended to its list (choice index), in whatever order atomics give.
__global__ void find_kernel(long long choices, int e, const int* expert, int* list, int* count) {
  const long long a = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (a < choices && expert[a] == e) list[atomicAdd(count, 1)] = static_cast<int>(a);
}

__global__ void gather_kernel(int rows, int width, int k, const int* list, const bf16* src, bf16* dst) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<long long>(rows) * width) return;
  dst[i] = src[static_cast<long long>(list[i / width] / k) * width + i % width];
}

__global__ void silu_mul_kernel(long long n, const bf16* g, const bf16* u, bf16* h) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float a = __bfloat162float(g[i]);
  h[i] = __float2bfloat16(a / (1.0f + expf(-a)) * __bfloat162float(u[i]));
}

__global__ void silu_mul_backward_kernel(long long n, const bf16* g, const bf16* u, const bf16* dh, bf16* dg, bf16* du) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float a = __bfloat162float(g[i]), b = __bfloat162float(u[i]), d = __bfloat162float(dh[i]);
  const float s = 1.0f / (1.0f + expf(-a));
  dg[i] = __float2bfloat16(d * b * s * (1.0f + a * (1.0f - s)));
  du[i] = __float2bfloat16(d * a * s);
}

// y[token] += w · rows[i] (scale null: weight 1), with atomics.
__global__ void scatter_add_kernel(int rows, int width, int k, const int* list, const float* weight, const bf16* src,
                                   float* y) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<long long>(rows) * width) return;
  const int a = list[i / width];
  const float w = weight ? weight[a] : 1.0f;
  atomicAdd(&y[static_cast<long long>(a / k) * width + i % width], w * __bfloat162float(src[i]));
}

__global__ void scatter_add_f32_kernel(int rows, int width, int k, const int* list, const float* src, float* y) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<long long>(rows) * width) return;
  atomicAdd(&y[static_cast<long long>(list[i / width] / k) * width + i % width], src[i]);
}

// A thread per row: dw[choice] = ⟨dy[token], out[i]⟩ and d_out[i] = w · dy[token].
__global__ void combine_backward_kernel(int rows, int width, int k, const int* list, const float* weight, const bf16* dy,
                                        const bf16* out, bf16* d_out, float* dw) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows) return;
  const int a = list[i];
  const bf16* g = dy + static_cast<long long>(a / k) * width;
  float dot = 0;
  for (int c = 0; c < width; ++c) {
    const float gv = __bfloat162float(g[c]);
    dot += gv * __bfloat162float(out[static_cast<long long>(i) * width + c]);
    d_out[static_cast<long long>(i) * width + c] = __float2bfloat16(weight[a] * gv);
  }
  dw[a] = dot;
}

__global__ void router_backward_kernel(int tokens, int experts, int k, const float* probs, const int* expert,
                                       const float* dw, bf16* dlogits) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  const float* p = probs + static_cast<long long>(t) * experts;
  float sds = 0;  // Σ_e p_e · ds_e, with ds nonzero at the chosen experts only
  for (int j = 0; j < k; ++j) sds += p[expert[static_cast<long long>(t) * k + j]] * dw[static_cast<long long>(t) * k + j];
  for (int e = 0; e < experts; ++e) {
    float ds = 0;
    for (int j = 0; j < k; ++j)
      if (expert[static_cast<long long>(t) * k + j] == e) ds = dw[static_cast<long long>(t) * k + j];
    dlogits[static_cast<long long>(t) * experts + e] = __float2bfloat16(p[e] * (ds - sds));
  }
}

__global__ void to_bf16_kernel(long long n, const float* in, bf16* out) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = __float2bfloat16(in[i]);
}

unsigned blocks(long long n) { return static_cast<unsigned>((n + 255) / 256); }

}  // namespace

std::vector<int> expert_loads(int tokens, int experts, int top_k, bool skewed, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> w(experts);
  for (int e = 0; e < experts; ++e) w[e] = skewed ? 1.0 / (e + 1) : 1.0;
  std::vector<int> counts(experts, 0);
  for (int t = 0; t < tokens; ++t) {
    std::vector<double> left = w;  // without replacement: a chosen expert's weight drops to 0
    for (int j = 0; j < top_k; ++j) {
      std::discrete_distribution<int> pick(left.begin(), left.end());
      const int e = pick(rng);
      ++counts[e];
      left[e] = 0;
    }
  }
  return counts;
}

struct NaiveMoe::State {
  MoeProblem p;
  cublasHandle_t blas{};
  DeviceBuffer<float> logits, probs, weight, y32, dx32, dw, dx_e;
  DeviceBuffer<int> expert, lists, count;
  DeviceBuffer<bf16> y, dx, dlogits;
  // Per-row activations of every expert, stacked in the order the experts were visited.
  DeviceBuffer<bf16> xe, g, u, h, out, dye, dout, dh, dg, du, sg, su, sh, sdh, sdg, sdu;
  std::vector<int> counts;
  DeviceBuffer<float> grad_router, grad13, grad2, grad_s13, grad_s2;

  // Row-major C[M][N] = op(A) · op(B) (+ C when beta = 1), leading dimensions as stored:
  // cuBLAS is column-major, so it computes Cᵀ = op(B)ᵀ · op(A)ᵀ on the same buffers.
  void gemm(bool ta, bool tb, int M, int N, int K, const bf16* A, int lda, const bf16* B, int ldb, void* C, bool f32,
            float beta = 0.0f) {
    if (M == 0 || N == 0) return;
    const float alpha = 1.0f;
    K2C_CUBLAS_CHECK(cublasGemmEx(blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha,
                                  B, CUDA_R_16BF, ldb, A, CUDA_R_16BF, lda, &beta, C, f32 ? CUDA_R_32F : CUDA_R_16BF, N,
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
};

NaiveMoe::NaiveMoe(const MoeProblem& p) : s_(std::make_unique<State>()) {
  K2C_CHECK(p.tokens > 0 && p.experts > 0 && p.top_k > 0 && p.top_k <= p.experts && p.shared_ffn > 0,
            "NaiveMoe: needs tokens, experts, top_k <= experts and shared_ffn all > 0");
  State& s = *s_;
  s.p = p;
  K2C_CUBLAS_CHECK(cublasCreate(&s.blas));
  const long long T = p.tokens, d = p.hidden, f = p.ffn, sf = p.shared_ffn, E = p.experts, R = T * p.top_k;
  s.logits = DeviceBuffer<float>(T * E);
  s.probs = DeviceBuffer<float>(T * E);
  s.weight = DeviceBuffer<float>(R);
  s.dw = DeviceBuffer<float>(R);
  s.y32 = DeviceBuffer<float>(T * d);
  s.dx32 = DeviceBuffer<float>(T * d);
  s.dx_e = DeviceBuffer<float>(R * d);
  s.expert = DeviceBuffer<int>(R);
  s.lists = DeviceBuffer<int>(R);
  s.count = DeviceBuffer<int>(E);
  s.y = DeviceBuffer<bf16>(T * d);
  s.dx = DeviceBuffer<bf16>(T * d);
  s.dlogits = DeviceBuffer<bf16>(T * E);
  for (DeviceBuffer<bf16>* b : {&s.xe, &s.out, &s.dye, &s.dout}) *b = DeviceBuffer<bf16>(R * d);
  for (DeviceBuffer<bf16>* b : {&s.g, &s.u, &s.h, &s.dh, &s.dg, &s.du}) *b = DeviceBuffer<bf16>(R * f);
  for (DeviceBuffer<bf16>* b : {&s.sg, &s.su, &s.sh, &s.sdh, &s.sdg, &s.sdu}) *b = DeviceBuffer<bf16>(T * sf);
  s.grad_router = DeviceBuffer<float>(E * d);
  s.grad13 = DeviceBuffer<float>(E * 2 * f * d);
  s.grad2 = DeviceBuffer<float>(E * d * f);
  s.grad_s13 = DeviceBuffer<float>(2 * sf * d);
  s.grad_s2 = DeviceBuffer<float>(d * sf);
}

NaiveMoe::~NaiveMoe() {
  if (s_ && s_->blas) cublasDestroy(s_->blas);
}

void NaiveMoe::step() {
  State& s = *s_;
  const MoeProblem& p = s.p;
  const int T = p.tokens, d = p.hidden, f = p.ffn, sf = p.shared_ffn, E = p.experts, k = p.top_k;
  const long long R = static_cast<long long>(T) * k;

  // ---- forward ----
  s.gemm(false, true, T, E, d, p.x, d, p.w_router, d, s.logits.data(), true);
  softmax_kernel<<<blocks(T), 256>>>(T, E, s.logits.data(), s.probs.data());
  topk_kernel<<<blocks(T), 256>>>(T, E, k, s.probs.data(), s.expert.data(), s.weight.data());
  K2C_CUDA_CHECK_LAUNCH();
  // Shared experts straight into the fp32 output.
  s.gemm(false, true, T, sf, d, p.x, d, p.shared_w13, d, s.sg.data(), false);
  s.gemm(false, true, T, sf, d, p.x, d, p.shared_w13 + static_cast<long long>(sf) * d, d, s.su.data(), false);
  silu_mul_kernel<<<blocks(static_cast<long long>(T) * sf), 256>>>(static_cast<long long>(T) * sf, s.sg.data(), s.su.data(), s.sh.data());
  s.gemm(false, true, T, d, sf, s.sh.data(), sf, p.shared_w2, sf, s.y32.data(), true);
  // Routed experts, one at a time.
  K2C_CUDA_CHECK(cudaMemset(s.count.data(), 0, E * sizeof(int)));
  s.counts.assign(E, 0);
  long long row = 0;
  for (int e = 0; e < E; ++e) {
    int* list = s.lists.data() + row;
    find_kernel<<<blocks(R), 256>>>(R, e, s.expert.data(), list, s.count.data() + e);
    K2C_CUDA_CHECK(cudaMemcpy(&s.counts[e], s.count.data() + e, sizeof(int), cudaMemcpyDeviceToHost));
    const int m = s.counts[e];
    if (m > 0) {
      const long long md = static_cast<long long>(m) * d, mf = static_cast<long long>(m) * f;
      bf16 *xe = s.xe.data() + row * d, *g = s.g.data() + row * f, *u = s.u.data() + row * f,
           *h = s.h.data() + row * f, *out = s.out.data() + row * d;
      const bf16* w13 = p.w13 + static_cast<long long>(e) * 2 * f * d;
      gather_kernel<<<blocks(md), 256>>>(m, d, k, list, p.x, xe);
      s.gemm(false, true, m, f, d, xe, d, w13, d, g, false);
      s.gemm(false, true, m, f, d, xe, d, w13 + static_cast<long long>(f) * d, d, u, false);
      silu_mul_kernel<<<blocks(mf), 256>>>(mf, g, u, h);
      s.gemm(false, true, m, d, f, h, f, p.w2 + static_cast<long long>(e) * d * f, f, out, false);
      scatter_add_kernel<<<blocks(md), 256>>>(m, d, k, list, s.weight.data(), out, s.y32.data());
      K2C_CUDA_CHECK_LAUNCH();
    }
    row += m;
  }
  to_bf16_kernel<<<blocks(static_cast<long long>(T) * d), 256>>>(static_cast<long long>(T) * d, s.y32.data(), s.y.data());

  // ---- backward ----
  s.gemm(false, false, T, sf, d, p.dy, d, p.shared_w2, sf, s.sdh.data(), false);
  s.gemm(true, false, d, sf, T, p.dy, d, s.sh.data(), sf, s.grad_s2.data(), true);
  silu_mul_backward_kernel<<<blocks(static_cast<long long>(T) * sf), 256>>>(static_cast<long long>(T) * sf, s.sg.data(), s.su.data(),
                                                                         s.sdh.data(), s.sdg.data(), s.sdu.data());
  s.gemm(true, false, sf, d, T, s.sdg.data(), sf, p.x, d, s.grad_s13.data(), true);
  s.gemm(true, false, sf, d, T, s.sdu.data(), sf, p.x, d, s.grad_s13.data() + static_cast<long long>(sf) * d, true);
  s.gemm(false, false, T, d, sf, s.sdg.data(), sf, p.shared_w13, d, s.dx32.data(), true);
  s.gemm(false, false, T, d, sf, s.sdu.data(), sf, p.shared_w13 + static_cast<long long>(sf) * d, d, s.dx32.data(), true, 1.0f);
  row = 0;
  for (int e = 0; e < E; ++e) {
    const int m = s.counts[e];
    float* g13 = s.grad13.data() + static_cast<long long>(e) * 2 * f * d;
    float* g2 = s.grad2.data() + static_cast<long long>(e) * d * f;
    if (m == 0) {
      K2C_CUDA_CHECK(cudaMemset(g13, 0, sizeof(float) * 2 * f * d));
      K2C_CUDA_CHECK(cudaMemset(g2, 0, sizeof(float) * d * f));
      continue;
    }
    const long long md = static_cast<long long>(m) * d, mf = static_cast<long long>(m) * f;
    const int* list = s.lists.data() + row;
    bf16 *xe = s.xe.data() + row * d, *g = s.g.data() + row * f, *u = s.u.data() + row * f, *h = s.h.data() + row * f,
         *out = s.out.data() + row * d, *dout = s.dout.data() + row * d, *dh = s.dh.data() + row * f,
         *dg = s.dg.data() + row * f, *du = s.du.data() + row * f;
    const bf16* w13 = p.w13 + static_cast<long long>(e) * 2 * f * d;
    const bf16* w2 = p.w2 + static_cast<long long>(e) * d * f;
    float* dxe = s.dx_e.data() + row * d;
    combine_backward_kernel<<<blocks(m), 256>>>(m, d, k, list, s.weight.data(), p.dy, out, dout, s.dw.data());
    s.gemm(false, false, m, f, d, dout, d, w2, f, dh, false);
    s.gemm(true, false, d, f, m, dout, d, h, f, g2, true);
    silu_mul_backward_kernel<<<blocks(mf), 256>>>(mf, g, u, dh, dg, du);
    s.gemm(true, false, f, d, m, dg, f, xe, d, g13, true);
    s.gemm(true, false, f, d, m, du, f, xe, d, g13 + static_cast<long long>(f) * d, true);
    s.gemm(false, false, m, d, f, dg, f, w13, d, dxe, true);
    s.gemm(false, false, m, d, f, du, f, w13 + static_cast<long long>(f) * d, d, dxe, true, 1.0f);
    scatter_add_f32_kernel<<<blocks(md), 256>>>(m, d, k, list, dxe, s.dx32.data());
    K2C_CUDA_CHECK_LAUNCH();
    row += m;
  }
  router_backward_kernel<<<blocks(T), 256>>>(T, E, k, s.probs.data(), s.expert.data(), s.dw.data(), s.dlogits.data());
  s.gemm(true, false, E, d, T, s.dlogits.data(), E, p.x, d, s.grad_router.data(), true);
  s.gemm(false, false, T, d, E, s.dlogits.data(), E, p.w_router, d, s.dx32.data(), true, 1.0f);
  to_bf16_kernel<<<blocks(static_cast<long long>(T) * d), 256>>>(static_cast<long long>(T) * d, s.dx32.data(), s.dx.data());
  K2C_CUDA_CHECK_LAUNCH();
}

namespace {
std::vector<float> widen_device(const DeviceBuffer<bf16>& b) {
  const std::vector<bf16> h = b.download();
  std::vector<float> out(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) out[i] = __bfloat162float(h[i]);
  return out;
}
}  // namespace

std::vector<float> NaiveMoe::y() const { return widen_device(s_->y); }
std::vector<float> NaiveMoe::dx() const { return widen_device(s_->dx); }
std::vector<int> NaiveMoe::expert() const { return s_->expert.download(); }
std::array<const float*, 5> NaiveMoe::weight_grads() const {
  return {s_->grad_router.data(), s_->grad13.data(), s_->grad2.data(), s_->grad_s13.data(), s_->grad_s2.data()};
}

}  // namespace k2c::baseline
